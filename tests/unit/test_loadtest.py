"""The load tool's memory record (``tools/loadtest.py``): the total and each process's series."""

import asyncio

from vllm_selfspec.tools.loadtest import LoadResult, _sample_rss


def test_rss_is_kept_in_all_and_by_process():
    samples = [{"server[1]": 3 << 20, "core[2]": 5 << 20}, {"server[1]": 4 << 20}]

    async def sample_twice(res):
        stop = asyncio.Event()

        def rss():  # the second sample is the last: the core process has gone
            if len(samples) == 1:
                stop.set()
            return samples.pop(0)

        await _sample_rss(rss, res, 0.0, stop, every_s=0.01)

    res = LoadResult()
    asyncio.run(sample_twice(res))
    assert [b for _, b in res.rss] == [8 << 20, 4 << 20]
    assert {k: [b for _, b in v] for k, v in res.rss_by_process.items()} == {
        "server[1]": [3 << 20, 4 << 20],
        "core[2]": [5 << 20],
    }
