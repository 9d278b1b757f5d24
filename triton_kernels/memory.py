"""Memory arithmetic for the shadow-token LM-head projection (numbers quoted in README.md).

Run ``python -m vllm_selfspec.kernels.memory`` to print the table. A shadow projection has
N = layers x (gamma + 1) rows: one per captured layer for each verified position of a step (gamma
draft tokens plus the bonus token). Materialising their float32 logits costs N x V x 4 bytes (and a
plain ``torch.softmax`` allocates the same again for the probabilities); the Triton kernel keeps
only its split-V partials: four [num_splits, N] buffers of 4 bytes. With ``norm_weight`` the rows
are first normalised in PyTorch (``lm_head_input``): N x d more, in float32 while it runs and in
the weight's dtype after, not counted here (Llama-3-8B's 288 x 4096 rows: 4.5 MiB per float32
copy; 13.9 MiB peak extra for the whole call on an H200, docs/results/kernels-h200/bench.txt).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_selfspec.kernels.lm_head_argmax import launch_config

# H100 SXM has 132 SMs; the kernel aims for 2 programs per SM (see lm_head_argmax._target_programs).
H100_TARGET_PROGRAMS = 2 * 132

MIB = 1024**2


@dataclass(frozen=True)
class ShadowMemory:
    name: str
    layers: int
    vocab: int
    hidden: int
    gamma: int
    rows: int
    logits_bytes: int  # float32 [N, V] logits
    workspace_bytes: int  # the kernel's split-V partials
    num_splits: int
    weight_bytes: int  # the bf16 LM-head weight, for scale

    @property
    def saved_bytes(self) -> int:
        return self.logits_bytes - self.workspace_bytes


def shadow_memory(
    name: str,
    layers: int,
    vocab: int,
    hidden: int,
    gamma: int,
    target_programs: int = H100_TARGET_PROGRAMS,
) -> ShadowMemory:
    rows = layers * (gamma + 1)
    splits = launch_config(rows, vocab, target_programs).splits
    return ShadowMemory(
        name=name,
        layers=layers,
        vocab=vocab,
        hidden=hidden,
        gamma=gamma,
        rows=rows,
        logits_bytes=rows * vocab * 4,
        workspace_bytes=4 * splits * rows * 4,
        num_splits=splits,
        weight_bytes=vocab * hidden * 2,
    )


EXAMPLES = (
    dict(name="Llama-3-8B", layers=32, vocab=128256, hidden=4096, gamma=8),
    dict(name="SmolLM2-135M (embedded)", layers=30, vocab=49152, hidden=576, gamma=4),
)


def markdown_table() -> str:
    lines = [
        "| model | L | V | d | γ | rows N = L(γ+1) | float32 logits | kernel workspace (splits) "
        "| saved | bf16 LM-head weight |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ex in EXAMPLES:
        m = shadow_memory(**ex)
        lines.append(
            f"| {m.name} | {m.layers} | {m.vocab} | {m.hidden} | {m.gamma} | {m.rows} "
            f"| {m.logits_bytes:,} B = {m.logits_bytes / MIB:.1f} MiB "
            f"| {m.workspace_bytes:,} B ({m.num_splits}) "
            f"| {m.saved_bytes / MIB:.1f} MiB | {m.weight_bytes / MIB:.0f} MiB |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
