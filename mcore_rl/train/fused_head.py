"""The LM head applied by the engine, fused with the log-prob, on the tokens that need it.

Megatron's ``GPTModel`` ends with its (vocab-parallel) output layer: [tokens, vocab/tp]
logits for every position, prompt and padding included, that the log-prob then reads once.
`defer_output_layer` turns that layer into a pass-through on the model's last stage, so the
model returns its final hidden states; `response_logprobs` then applies the output weight
only at positions whose next token is a response token, in chunks, through
`mcore_rl.kernels.linear_token_logprobs` (log-prob and entropy without the full logits, and
a backward that never holds a [tokens, vocab] gradient). Prompt and padding positions, which
no RL loss reads, cost nothing in the LM head.

The parameters stay where they were (same names, same tied-embedding copy on the last
stage), so checkpoints, DDP gradient buffers and weight sync see the model unchanged.
"""
from __future__ import annotations

import torch

from mcore_rl.data.batch import Batch


def unwrap(chunk):
    """The model inside its wrappers (DDP, Float16Module), or the chunk itself."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def defer_output_layer(chunks: list) -> torch.Tensor | None:
    """Make the model's output layer return its input; the output weight it would have used
    (None on ranks without the output layer, i.e. not the last pipeline stage)."""
    model = unwrap(chunks[-1])
    if not getattr(model, "post_process", False):
        return None
    layer = model.output_layer
    sequence_parallel = model.config.sequence_parallel

    def passthrough(hidden, weight=None, runtime_gather_output=None):
        if sequence_parallel:
            # [s/tp, b, H] -> [s, b, H]. The vocabulary-parallel log-prob already sums the
            # hidden states' gradient over the TP ranks, so the backward only keeps each
            # rank's slice of it (no second sum).
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return hidden, None

    layer.forward = passthrough
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return layer.weight


def reported_kept_ids(mb: Batch, truncated: bool) -> torch.Tensor | None:
    """The engine's kept set of each token [b, T - 1, K] (-1 padded), aligned with the labels
    ``input_ids[:, 1:]``, when the batch carries it and the log-probs are truncated."""
    if not truncated or "kept_ids" not in mb:
        return None
    return mb["kept_ids"][:, 1:].long() - 1


def response_logprobs(hidden: torch.Tensor, weight: torch.Tensor, mb: Batch, *, vocab_size,
                      tp_group, temperature: float, with_entropy: bool, impl: str,
                      truncation: tuple[int, float] = (-1, 1.0)) -> dict[str, torch.Tensor]:
    """``hidden`` [b, T, H] -> ``logprobs`` (and ``entropy``) [b, T] fp32, aligned to the token
    they describe, at response tokens (0 elsewhere). A ``truncation`` (top_k, top_p) other
    than none: those of the truncated distribution, and ``kept`` (1/0) too."""
    from mcore_rl.kernels import linear_token_logprobs

    ids = mb["input_ids"]
    target = mb["response_mask"][:, 1:].bool()  # position t predicts token t + 1
    truncated = truncation != (-1, 1.0)
    kept_ids = reported_kept_ids(mb, truncated)
    res = linear_token_logprobs(hidden[:, :-1][target], weight, ids[:, 1:][target],
                                vocab_size=vocab_size, tp_group=tp_group, temperature=temperature,
                                return_entropy=with_entropy, impl=impl, top_k=truncation[0],
                                top_p=truncation[1], return_kept=truncated,
                                kept_ids=None if kept_ids is None else kept_ids[target])
    flat = list(res) if isinstance(res, tuple) else [res]
    names = ["logprobs"] + (["entropy"] if with_entropy else []) + (["kept"] if truncated else [])

    def place(values: torch.Tensor) -> torch.Tensor:
        values = values.float()
        out = torch.zeros(target.shape, dtype=values.dtype, device=values.device)
        return torch.nn.functional.pad(out.masked_scatter(target, values), (1, 0))

    return {name: place(v) for name, v in zip(names, flat)}
