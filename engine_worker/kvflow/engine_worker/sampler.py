"""Batched sampling: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

All rows are filtered in one sorted pass, then each row draws one uniform number and takes
the token where its cumulative probability crosses it (inverse CDF). One draw per row is
what makes a seed reproducible whatever else is in the batch: a seeded request owns a
``torch.Generator`` and consumes exactly one number from it per token.

Logprobs are of the model's distribution before temperature and filtering, as OpenAI
reports them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.engine_worker.core.engine import SampledToken
from kvflow.engine_worker.core.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", *, default_seed: int = 0) -> None:
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}
        # Unseeded requests share one generator: random, but the worker as a whole is
        # reproducible for a fixed arrival order.
        self._shared = torch.Generator(device="cpu").manual_seed(default_seed)

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _uniform(self, request_id: str, params: SamplingParams) -> float:
        gen = self._shared
        if params.seed is not None:
            if request_id not in self._generators:
                self._generators[request_id] = torch.Generator().manual_seed(params.seed)
            gen = self._generators[request_id]
        return float(torch.rand((), generator=gen))

    def sample(
        self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]
    ) -> list[SampledToken]:
        """Sample one token per row of ``logits`` ``[N, vocab]`` (float32)."""
        assert logits.shape[0] == len(request_ids) == len(params)
        logits = logits.float()
        num_rows = logits.shape[0]
        greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
        chosen = logits.argmax(dim=-1)

        if not bool(greedy.all()):
            sampled = self._sample_random(logits, request_ids, params, greedy)
            chosen = torch.where(greedy, chosen, sampled)

        want_logprobs = [p.logprobs or p.top_logprobs > 0 for p in params]
        logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        max_top = max((p.top_logprobs for p in params), default=0)
        top_vals = top_ids = None
        if logprobs is not None and max_top > 0:
            top_vals, top_ids = logprobs.topk(max_top, dim=-1)

        chosen_list = chosen.tolist()
        chosen_lp = (
            logprobs.gather(1, chosen[:, None])[:, 0].tolist() if logprobs is not None else None
        )
        out: list[SampledToken] = []
        for i in range(num_rows):
            p = params[i]
            if chosen_lp is None or not want_logprobs[i]:
                out.append(SampledToken(int(chosen_list[i])))
                continue
            n = p.top_logprobs
            ids = tuple(top_ids[i, :n].tolist()) if top_ids is not None and n else ()
            vals = tuple(top_vals[i, :n].tolist()) if top_vals is not None and n else ()
            out.append(SampledToken(int(chosen_list[i]), float(chosen_lp[i]), ids, vals))
        return out

    def _sample_random(
        self,
        logits: torch.Tensor,
        request_ids: Sequence[str],
        params: Sequence[SamplingParams],
        greedy: torch.Tensor,
    ) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[-1]
        temperature = torch.tensor(
            [p.temperature if not p.is_greedy else 1.0 for p in params], device=device
        )
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        min_p = torch.tensor([p.min_p for p in params], device=device)

        scaled = logits / temperature[:, None]
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        ranks = torch.arange(vocab, device=device)[None, :]
        keep = ranks < top_k[:, None]
        # top-p keeps the smallest head whose mass reaches p: a token stays if the mass
        # before it is still short of p (so the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= mass_before < top_p[:, None]
        keep &= probs >= min_p[:, None] * probs[:, :1]
        probs = probs * keep
        cdf = probs.cumsum(dim=-1)

        u = torch.tensor(
            [
                0.0 if bool(greedy[i]) else self._uniform(request_ids[i], params[i])
                for i in range(len(params))
            ],
            device=device,
            dtype=cdf.dtype,
        )
        threshold = u * cdf[:, -1]
        index = torch.searchsorted(cdf, threshold[:, None], right=True).clamp(max=vocab - 1)
        # Never land on a filtered token (possible only through float ties at the edge).
        index = torch.minimum(index, keep.sum(dim=-1, keepdim=True) - 1)
        return sorted_ids.gather(1, index)[:, 0]
