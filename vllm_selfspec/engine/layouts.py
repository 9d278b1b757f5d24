"""The decoder-layer layouts of the supported model families: how the partial forward
(engine/executor.py) reaches a loaded vLLM model's embedding, layers, norms, blocks and LM head.

``model_layout(model)`` picks the adapter: ``LlamaLayout`` (Llama, Mistral, Qwen2, Qwen3) or
``GemmaLayout`` (Gemma 2/3, a norm after each sub-layer). The attribute names they read are
vLLM's (compat.py lists them); the one collective they need goes through compat.
"""

from __future__ import annotations

import torch

from .. import compat
from . import draft_attention


def model_layout(model) -> LlamaLayout:
    """The layout adapter of a loaded vLLM model: ``GemmaLayout`` for decoder layers with a norm
    after each sub-layer (Gemma 2/3), else ``LlamaLayout`` (Llama, Mistral, Qwen2, Qwen3)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is not None and len(layers) and hasattr(layers[0], "pre_feedforward_layernorm"):
        return GemmaLayout(model)
    return LlamaLayout(model)


class LlamaLayout:
    """Access to the pieces of a vLLM model in the Llama decoder-layer form, for the partial
    forward: Llama, Mistral, Qwen2 and Qwen3 (``config.SUPPORTED_ARCHITECTURES``), whose
    differences (attention biases, q/k norms) stay inside ``self_attn``.

    A decoder layer is two sub-layers in vLLM's fused (pending, residual) form; each is
    ``x, res = <norm>(pending, res)`` then ``pending = <block>(x)``. The methods below name a
    family's norms and blocks; ``engine/executor.py`` runs them."""

    #: the decoder-layer modules this layout reads
    LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")

    def __init__(self, model) -> None:
        inner = getattr(model, "model", None)
        need = ("embed_input_ids", "layers", "norm")
        if (
            inner is None
            or not all(hasattr(inner, n) for n in need)
            or not hasattr(model, "compute_logits")
        ):
            raise RuntimeError(
                f"selfspec cannot split {type(model).__name__}: expected a vLLM Llama-family "
                f"model with .model.embed_input_ids/.layers/.norm and .compute_logits"
            )
        for i, layer in enumerate(inner.layers):
            for n in self.LAYER_PARTS:
                if not hasattr(layer, n):
                    raise RuntimeError(
                        f"selfspec: decoder layer {i} of {type(model).__name__} "
                        f"has no {n}; unsupported layer layout"
                    )
            if getattr(layer, "ada_rms_norm_t_cond", None) is not None:  # Mistral's audio models
                raise RuntimeError(
                    f"selfspec: decoder layer {i} of {type(model).__name__} conditions its MLP "
                    f"input (ada_rms_norm_t_cond), which the partial forward does not run"
                )
        if getattr(inner, "start_layer", 0) != 0 or getattr(
            inner, "end_layer", len(inner.layers)
        ) != len(inner.layers):
            raise RuntimeError(
                "selfspec needs every decoder layer on this rank "
                "(pipeline parallelism is not supported)"
            )
        self.model = model
        self.embed = inner.embed_input_ids  # token ids -> the residual stream's first rows
        self.layers = inner.layers
        self.norm = inner.norm
        self.compute_logits = model.compute_logits
        self.embed_weight = inner.embed_tokens.weight  # a vocab shard under TP (rank 0: rows 0..)
        self.attn_layer_names = [layer.self_attn.attn.layer_name for layer in inner.layers]
        proc = model.logits_processor
        self.logit_scale, self.logit_soft_cap = proc.scale, proc.soft_cap

    # ---- the two sub-layers of a decoder layer ----------------------------------------------
    def attn_norm(self, layer):
        """The norm in front of attention (fused add + norm with a residual)."""
        return layer.input_layernorm

    def attn(self, layer, positions: torch.Tensor, x: torch.Tensor, paged: bool = False):
        """Attention's contribution to the residual stream, from its normed input. ``paged``:
        the drafter's own paged attention (engine/draft_attention.py) in place of vLLM's, in
        ``LlamaAttention.forward``'s steps (``check_paged_attention``)."""
        sa = layer.self_attn
        if not paged:
            return sa(positions=positions, hidden_states=x)
        qkv, _ = sa.qkv_proj(x)
        q, k, v = qkv.split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
        q, k = sa.rotary_emb(positions, q, k)
        out, _ = sa.o_proj(draft_attention.attend(q, k, v, sa.attn.layer_name))
        return out

    def check_paged_attention(self, layer) -> None:
        """Raises ``NotImplementedError`` unless ``attn(..., paged=True)`` runs this layer's
        attention as its own forward does."""
        if not compat.is_llama_attention(layer.self_attn):
            raise NotImplementedError(
                f"{type(layer.self_attn).__name__} is not vLLM's LlamaAttention"
            )

    def mlp_norm(self, layer):
        """The norm in front of the MLP."""
        return layer.post_attention_layernorm

    def mlp(self, layer, x: torch.Tensor) -> torch.Tensor:
        """The MLP's contribution to the residual stream, from its normed input."""
        return layer.mlp(x)

    def final_norm_scale(self) -> torch.Tensor:
        """The final RMSNorm's multiplier (the fused LM-head argmax applies it)."""
        return self.norm.weight

    # ---- the rest ---------------------------------------------------------------------------
    def lm_head_rows(self, ids):
        """Rows ``ids`` of the LM-head weight [len(ids), d], replicated on every TP rank (vLLM's
        head is sharded by vocabulary: each rank fills the rows it owns, then an all-reduce)."""
        head = self.model.lm_head
        w = head.weight
        start = head.shard_indices.org_vocab_start_index
        end = head.shard_indices.org_vocab_end_index
        ids = ids.to(w.device)
        mine = (ids >= start) & (ids < end)
        rows = torch.zeros(len(ids), w.shape[1], dtype=w.dtype, device=w.device)
        rows[mine] = w[ids[mine] - start]
        return compat.tp_all_reduce(rows)

    def set_capture_layers(self, layers: tuple[int, ...], run_layer=None) -> None:
        """Make the model's forward also return the residual stream after each of ``layers``
        layers (vLLM's EAGLE-3 hook, ``SupportsEagle3.set_aux_hidden_state_layers``, whose
        outputs are graph outputs: the model stays compiled). ``run_layer``: see GemmaLayout."""
        self.model.set_aux_hidden_state_layers(tuple(layers))


class GemmaLayout(LlamaLayout):
    """Gemma 2 and Gemma 3: each sub-layer's output passes its own norm before it joins the
    residual stream (``post_attention_layernorm``, ``post_feedforward_layernorm``), the MLP's
    input norm is ``pre_feedforward_layernorm``, RMSNorms scale by ``1 + weight``, and the
    embeddings are scaled by sqrt(hidden) (inside ``embed_input_ids``). Attention soft-capping
    (Gemma 2) stays inside ``self_attn``; the final logit soft cap in ``logits_processor``.
    vLLM's Gemma models have no EAGLE-3 hook: ``set_capture_layers`` gives the model a forward
    that collects the residual stream itself (the same operations, in the same order), each
    layer through ``run_layer(layer, positions, h, residual)`` (the draft forwards' compiled
    layer function in vLLM's compiled mode: the loop runs outside vLLM's graph, its layers
    compiled), or the layer's own call."""

    LAYER_PARTS = (
        *LlamaLayout.LAYER_PARTS,
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )

    def attn(self, layer, positions, x, paged: bool = False):
        if paged:
            self.check_paged_attention(layer)
        return layer.post_attention_layernorm(layer.self_attn(positions=positions, hidden_states=x))

    def check_paged_attention(self, layer) -> None:
        raise NotImplementedError(
            "Gemma's attention (q/k norms, sliding windows) is not decomposed"
        )

    def mlp_norm(self, layer):
        return layer.pre_feedforward_layernorm

    def mlp(self, layer, x):
        return layer.post_feedforward_layernorm(layer.mlp(x))

    def final_norm_scale(self) -> torch.Tensor:
        return 1.0 + self.norm.weight.float()

    def set_capture_layers(self, layers: tuple[int, ...], run_layer=None) -> None:
        wanted = frozenset(layers)
        model, inner = self.model, self.model.model

        def forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
            h = inputs_embeds if inputs_embeds is not None else inner.embed_input_ids(input_ids)
            res, aux = None, []
            if 0 in wanted:
                aux.append(h)
            for i, layer in enumerate(inner.layers):
                if run_layer is None or kw:
                    h, res = layer(positions, h, res, **kw)
                else:  # the compiled function takes a residual stream (h + 0 == h)
                    h, res = run_layer(
                        layer, positions, h, torch.zeros_like(h) if res is None else res
                    )
                if i + 1 in wanted:
                    aux.append(h + res)
            return inner.norm(h, res)[0], aux

        model.forward = forward  # nn.Module.__call__ finds the instance attribute first
