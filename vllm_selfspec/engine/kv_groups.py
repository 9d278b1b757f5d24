"""The target's KV-cache groups, as the drafter sees them.

vLLM keeps attention KV in one KV-cache group when every layer attends alike, and in several when
sliding-window and full-attention layers interleave (Gemma 2/3, some Mistral and Qwen configs:
vLLM's hybrid KV-cache manager; Gemma-3-270M has 6 groups of 3 layers). Each group has its own
block table per request, its own block size and its own slot mapping, so one draft row writes a
different KV slot in each group. Everything the drafter runs over the paged cache (draft steps,
AdaDecode's rows, KnapSpec's read-only search) takes one block table per group and gets from here
one slot mapping and one attention metadata per group.

Worked example (two groups, block size 16 in both): a request whose block tables are
``[[7, 9]]`` (group 0) and ``[[3, 4]]`` (group 1) drafts at position 20: its slot is
``9 * 16 + 4 = 148`` in group 0's layers and ``4 * 16 + 4 = 68`` in group 1's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import compat


@dataclass
class KVGroup:
    gid: int  # vLLM's kv_cache_group_id
    block_size: int  # of its block table (vLLM's kernel block size)
    builders: list  # the drafter's own AttentionGroups over this group's layers
    layer_names: list[str]


def slots_of(table: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """KV slot of each row: ``table[row, pos // block_size] * block_size + pos % block_size``.

    >>> slots_of(torch.tensor([[7, 9]]), torch.tensor([20]), 16)
    tensor([148])
    """
    blk = table.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
    return blk.to(torch.int64) * block_size + pos % block_size


class KVGroups:
    """The KV-cache groups holding the layers the drafter runs, with metadata builders of the
    drafter's own (built once, so the target's builders and their persistent buffers are never
    disturbed)."""

    def __init__(self, runner, vllm_config, attn_layer_names: list[str]) -> None:
        _, _, AttentionGroup = compat.runner_internals()
        names = set(attn_layer_names)
        self.groups: list[KVGroup] = []
        #: metadata builds so far: a build may overwrite buffers an earlier build's metadata
        #: points into (FlashInfer keeps its plan in the builder's wrappers), so only the
        #: latest build is safe to use again (``latest``)
        self.builds = 0
        for gid, attn_groups in enumerate(runner.attn_groups):
            builders = []
            for g in attn_groups:
                sub = [n for n in g.layer_names if n in names]
                if not sub:
                    continue
                ng = AttentionGroup(
                    backend=g.backend,
                    layer_names=sub,
                    kv_cache_spec=g.kv_cache_spec,
                    kv_cache_group_id=gid,
                )
                ng.create_metadata_builders(
                    vllm_config, runner.device, kernel_block_size=g.kernel_block_size
                )
                builders.append(ng)
            if builders:
                block_size = runner.input_batch.block_table[gid].block_size
                layers = [n for b in builders for n in b.layer_names]
                self.groups.append(KVGroup(gid, block_size, builders, layers))
        covered = sum(len(g.layer_names) for g in self.groups)
        if covered != len(names):
            raise RuntimeError(
                f"selfspec: {len(names) - covered} of the model's {len(names)} attention layers "
                "are in no attention KV-cache group (attention-free or state-space layers are "
                "not supported)"
            )

    def tables(self, input_batch, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each group's block table of the batch's requests (of ``rows`` only, if given)."""
        n = len(input_batch.req_ids)
        out = [input_batch.block_table[g.gid].get_device_tensor(n) for g in self.groups]
        return out if rows is None else [t[rows.to(t.device)] for t in out]

    def slots(self, tables: list[torch.Tensor], pos: torch.Tensor) -> list[torch.Tensor]:
        """Each group's KV slot of row i at ``pos[i]`` (``tables``: one row per row of pos)."""
        return [slots_of(t, pos, g.block_size) for t, g in zip(tables, self.groups)]

    def metadata(self, cm, tables: list[torch.Tensor], slots: list[torch.Tensor], draft_index=0):
        """Attention metadata of every layer the drafter runs, and the slot-mapping dict, from a
        ``CommonAttentionMetadata`` ``cm`` whose block table and slots each group replaces."""
        self.builds += 1  # what an earlier build returned may be stale now (``latest``)
        md: dict = {}
        slot_map: dict = {}
        for g, table, slot in zip(self.groups, tables, slots):
            gcm = replace(cm, block_table_tensor=table, slot_mapping=slot)
            for b in g.builders:
                group_md = b.build_metadata_for_drafting(gcm, draft_index=draft_index)
                for name in b.layer_names:
                    md[name] = group_md
                    slot_map[name] = slot
        return md, slot_map

    def latest(self, cache: dict, key, build):
        """``build()`` (a value holding attention metadata), from ``cache`` only while no other
        metadata has been built since it: a drafter that goes back to an earlier subset of rows
        builds its metadata again rather than reuse what the builder may have overwritten."""
        hit = cache.get(key)
        if hit is not None and hit[0] == self.builds:
            return hit[1]
        value = build()
        cache[key] = (self.builds, value)
        return value

    def forward_slots(self) -> list[torch.Tensor]:
        """Each group's KV slot of every row of the target forward now running."""
        return [compat.forward_slot_mapping(g.layer_names[0]) for g in self.groups]
