"""Attention of the draft forwards: vLLM's backend, or the drafter's own paged attention.

A draft forward (a layer plan, Cascade's exit walk, AdaDecode's rounds, KnapSpec's search) runs
some of the target's layers for a few rows, over the target's own paged KV cache. Its attention
can run two ways (``compat.DRAFT_ATTENTION_ENV``):

* **backend**: vLLM's attention layer, under a forward context whose metadata the drafter's own
  metadata builders (``kv_groups.KVGroups``) built for those rows. Every backend works, but each
  subset of rows needs a metadata build, and a build may overwrite what an earlier one returned
  (``KVGroups.latest``).
* **paged**: the drafter's own kernel, ``vllm_selfspec.kernels.paged_attention``: each row writes
  its K/V at its slot, then attends over positions ``0 .. position`` of its request, read
  through its block table. No metadata builder is involved: a row is its block-table row, slot
  and position. The Triton kernels run on CUDA; elsewhere the PyTorch reference with the same
  interface does. The cache is read through views with the strides vLLM gave it
  (``compat.paged_kv_views``): FlashAttention's and FlashInfer's layout, and the CPU backend's
  (its ``vec``/``vec16`` kernels). The family's attention is decomposed around the kernel
  (``LlamaLayout.attn``: qkv projection, rotary, kernel, output projection).

``"auto"`` (the default) takes **paged** on CUDA where every attention layer allows it, else
**backend**. A forward runs paged attention inside ``DraftAttention.context()`` of a paged
``DraftAttention``; the attention op (``torch.ops.vllm_selfspec.paged_draft_attention``, opaque
to torch.compile like vLLM's own attention op, and taking the layer's name the same way) finds
the rows there.

Worked example: two requests draft one token each at positions 20 and 5; their block tables
(block size 16) are rows ``[[7, 9], [3, 0]]``, so their slots are ``9 * 16 + 4 = 148`` and
``3 * 16 + 5 = 53``::

    rows = PagedRows(tables=[table], slots=[torch.tensor([148, 53])],
                     positions=torch.tensor([20, 5]), req_indices=torch.tensor([0, 1]),
                     max_context=21)
    with DraftAttention.paged(rows, warm_up_context).context():
        h, res = executor.run(plan, tokens, positions)   # every layer's attention: the kernel
"""

import contextlib
from dataclasses import dataclass

import torch

from .. import compat
from ..kernels.paged_attention import paged_attention

#: the op's name (in the library ``vllm_selfspec``)
OP_NAME = "paged_draft_attention"


@dataclass
class PagedRows:
    """The rows of one paged draft forward, as the kernel sees them."""

    tables: list[torch.Tensor]  # per KV-cache group: block tables, [num_reqs, max_blocks]
    slots: list[torch.Tensor]  # per group: each row's KV slot [n] (negative: write nothing)
    positions: torch.Tensor  # [n]: each row's position (it attends to 0 .. position)
    req_indices: torch.Tensor  # [n]: each row's row in the block tables
    max_context: int  # at least every position + 1 (the kernel's context split, no host sync)


@dataclass
class PagedLayer:
    """One attention layer as the kernel reads it."""

    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_size], strided view
    value_cache: torch.Tensor
    group: int  # index of its KV-cache group in ``PagedRows.tables`` / ``slots``
    num_heads: int  # query heads on this rank
    num_kv_heads: int
    head_size: int
    scale: float


#: the attention layers the op serves (by vLLM layer name), and the rows of the paged forward
#: now running (None: none; the op then returns at once, as vLLM's attention does in warm-up)
_LAYERS: dict[str, PagedLayer] = {}
_CURRENT: PagedRows | None = None


def active() -> bool:
    """Whether a paged draft forward is running (its layers' attention is the kernel)."""
    return _CURRENT is not None


def _op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,  # vLLM's LayerNameType once registered (compat.register_layer_op)
) -> None:
    rows = _CURRENT
    if rows is None:  # compiling (warm-up): nothing to attend to, and nothing written
        return
    layer = _LAYERS[compat.resolve_layer_name(layer_name)]
    n, g = query.shape[0], layer.group
    out = paged_attention(
        query.view(n, layer.num_heads, layer.head_size),
        key.view(n, layer.num_kv_heads, layer.head_size),
        value.view(n, layer.num_kv_heads, layer.head_size),
        layer.key_cache,
        layer.value_cache,
        slot_mapping=rows.slots[g],
        block_table=rows.tables[g],
        req_indices=rows.req_indices,
        positions=rows.positions,
        scale=layer.scale,
        max_context=rows.max_context,
    )
    output.copy_(out.view(output.shape))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_name: str):
    """The layer's paged attention of the rows now running: ``[n, num_heads * head_size]``."""
    output = torch.empty_like(query)
    torch.ops.vllm_selfspec.paged_draft_attention(
        query, key, value, output, compat.encode_layer_name(layer_name)
    )
    return output


def bind_layers(layout, groups) -> None:
    """Read every attention layer's cache views (after vLLM allocated the KV cache); raises
    ``NotImplementedError`` naming what the kernel cannot serve (``compat.paged_kv_views``)."""
    group_of = {name: i for i, g in enumerate(groups.groups) for name in g.layer_names}
    layers = {}
    for layer in layout.layers:
        layout.check_paged_attention(layer)
        attn = layer.self_attn.attn
        key_cache, value_cache = compat.paged_kv_views(attn)
        layers[attn.layer_name] = PagedLayer(
            key_cache=key_cache,
            value_cache=value_cache,
            group=group_of[attn.layer_name],
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_size=attn.head_size,
            scale=float(attn.impl.scale),
        )
    compat.register_layer_op(OP_NAME, _op, mutates_args=["output"])
    _LAYERS.clear()
    _LAYERS.update(layers)


class DraftAttention:
    """The attention of one draft forward's rows: ``with attention.context(): <forward>``."""

    def __init__(self, enter) -> None:
        self._enter = enter

    def context(self):
        return self._enter()

    @classmethod
    def backend(cls, set_forward_context, metadata, num_tokens: int, slot_mapping: dict):
        """vLLM's attention, reading ``metadata`` and writing KV at ``slot_mapping``."""
        return cls(lambda: set_forward_context(metadata, num_tokens, slot_mapping))

    @classmethod
    def paged(cls, rows: PagedRows, plain_context):
        """The kernel over ``rows``; ``plain_context(n)``: vLLM's forward context without
        metadata, for whatever else of vLLM a forward may look up."""

        @contextlib.contextmanager
        def enter():
            global _CURRENT
            outer, _CURRENT = _CURRENT, rows
            try:
                with plain_context(int(rows.positions.shape[0])):
                    yield
            finally:
                _CURRENT = outer

        return cls(enter)
