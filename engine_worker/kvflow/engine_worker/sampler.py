"""Batched sampling: penalties, logit bias, min_tokens, per-request logits processors,
then greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

The logits are shaped first, each stage a few tensor ops over the rows that need it:
repetition, frequency and presence penalties (``penalties.py``), ``logit_bias``, then the
masks: EOS and stop tokens while a request is short of ``min_tokens``, and the allowed set
of a request's ``LogitsProcessor`` (``logits_processor.py``).

All rows are filtered in one sorted pass, then each row draws one uniform number and takes
the token where its cumulative probability crosses it (inverse CDF). One draw per row is
what makes a seed reproducible whatever else is in the batch: a seeded request owns a
``torch.Generator`` and consumes exactly one number from it per token.

Logprobs are of the model's distribution before penalties, bias, masks, temperature and
filtering (the raw distribution, as vLLM reports it by default).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.engine_worker.core.engine import SampledToken
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.penalties import TokenCounts, TokenHistory, apply_penalties


class Sampler:
    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        default_seed: int = 0,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.device = torch.device(device)
        # Masked while a request is short of its min_tokens (unless it ignores EOS).
        self.eos_token_ids = tuple(eos_token_ids)
        self._generators: dict[str, torch.Generator] = {}
        self._counts = TokenCounts(self.device)
        # Unseeded requests share one generator: random, but the worker as a whole is
        # reproducible for a fixed arrival order.
        self._shared = torch.Generator(device="cpu").manual_seed(default_seed)

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._counts.release(request_id)

    def _uniform(self, request_id: str, params: SamplingParams) -> float:
        gen = self._shared
        if params.seed is not None:
            if request_id not in self._generators:
                self._generators[request_id] = torch.Generator().manual_seed(params.seed)
            gen = self._generators[request_id]
        return float(torch.rand((), generator=gen))

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: Sequence[str],
        params: Sequence[SamplingParams],
        *,
        histories: Sequence[TokenHistory] | None = None,
    ) -> list[SampledToken]:
        """Sample one token per row of ``logits`` ``[N, vocab]`` (float32).

        ``histories`` (the engine's requests) give each row's prompt and outputs so far;
        required when a row has penalties, logit bias, min_tokens or a logits processor."""
        assert logits.shape[0] == len(request_ids) == len(params)
        if all(_is_plain_greedy(p) for p in params):
            # The common batch: one argmax and one copy out, no per-row tensors.
            return [SampledToken(t) for t in _argmax(logits).tolist()]
        raw = logits.float()
        num_rows = raw.shape[0]
        logits = self._shape(raw, request_ids, params, histories)
        chosen = _argmax(logits)
        if not all(p.is_greedy for p in params):
            chosen = self._sample_random(logits, chosen, request_ids, params)

        want_logprobs = [p.logprobs or p.top_logprobs > 0 for p in params]
        logprobs = torch.log_softmax(raw, dim=-1) if any(want_logprobs) else None
        max_top = max((p.top_logprobs for p in params), default=0)
        top_vals = top_ids = None
        if logprobs is not None and max_top > 0:
            top_vals, top_ids = logprobs.topk(max_top, dim=-1)

        # Each copy to the host waits for the device: one per tensor, none per row.
        chosen_list = chosen.tolist()
        chosen_lp = (
            logprobs.gather(1, chosen[:, None])[:, 0].tolist() if logprobs is not None else None
        )
        top_id_rows = top_ids.tolist() if top_ids is not None else None
        top_val_rows = top_vals.tolist() if top_vals is not None else None
        out: list[SampledToken] = []
        for i in range(num_rows):
            p = params[i]
            if chosen_lp is None or not want_logprobs[i]:
                out.append(SampledToken(int(chosen_list[i])))
                continue
            n = p.top_logprobs
            ids = tuple(top_id_rows[i][:n]) if top_id_rows is not None and n else ()
            vals = tuple(top_val_rows[i][:n]) if top_val_rows is not None and n else ()
            out.append(SampledToken(int(chosen_list[i]), float(chosen_lp[i]), ids, vals))
        return out

    def _shape(
        self,
        raw: torch.Tensor,
        request_ids: Sequence[str],
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory] | None,
    ) -> torch.Tensor:
        """Penalties, bias and masks applied to a copy of ``raw``; ``raw`` itself when no
        row asks for any (the common case costs one pass over the params)."""
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        short = [i for i, p in enumerate(params) if p.min_tokens > 0]
        processed = [i for i, p in enumerate(params) if p.logits_processor is not None]
        if not (penalized or biased or short or processed):
            return raw
        assert histories is not None and len(histories) == len(params), "pass histories"
        logits = raw.clone()
        device, vocab = logits.device, logits.shape[-1]
        if penalized:
            rows = torch.tensor(penalized, dtype=torch.int64, device=device)
            counts, in_prompt = self._counts.gather(
                [request_ids[i] for i in penalized], [histories[i] for i in penalized], vocab
            )
            chosen = [params[i] for i in penalized]
            if len(penalized) == len(params):  # every row: no gather and scatter back
                logits = apply_penalties(logits, counts, in_prompt, chosen)
            else:
                logits[rows] = apply_penalties(logits[rows], counts, in_prompt, chosen)
        if biased:
            bias_rows = [i for i in biased for _ in params[i].logit_bias]
            bias_ids = [t for i in biased for t, _ in params[i].logit_bias]
            values = [b for i in biased for _, b in params[i].logit_bias]
            logits.index_put_(
                (_long(bias_rows, device), _long(bias_ids, device)),
                torch.tensor(values, dtype=logits.dtype, device=device),
                accumulate=True,
            )
        # min_tokens: (row, token) pairs that may not be sampled yet.
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i in short:
            p, h = params[i], histories[i]
            if len(h.token_ids) - len(h.prompt_token_ids) >= p.min_tokens:
                continue
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            ban_rows += [i] * len(stops)
            ban_ids += sorted(stops)
        if processed:
            ban_rows, ban_ids = self._apply_processors(
                logits, processed, params, histories, ban_rows, ban_ids
            )
        if ban_ids:
            logits.index_put_(
                (_long(ban_rows, device), _long(ban_ids, device)),
                torch.tensor(float("-inf"), device=device),
            )
        return logits

    def _apply_processors(
        self,
        logits: torch.Tensor,
        processed: list[int],
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory],
        ban_rows: list[int],
        ban_ids: list[int],
    ) -> tuple[list[int], list[int]]:
        """Mask what each row's processor disallows, and the min_tokens bans of those rows
        unless they would leave nothing (the processor wins). Returns the other rows' bans."""
        device, vocab = logits.device, logits.shape[-1]
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        for i in processed:
            processor = params[i].logits_processor
            assert processor is not None
            h = histories[i]
            mask = processor.allowed_token_mask(h.token_ids[len(h.prompt_token_ids) :])
            if mask is None:
                continue
            assert mask.dtype == torch.bool and mask.dim() == 1 and mask.shape[0] <= vocab, (
                f"a logits processor returned {mask.dtype} {tuple(mask.shape)}; "
                f"want torch.bool [n <= {vocab}]"
            )
            rows.append(i)
            masks.append(mask.to(device, non_blocking=True))
        if not rows:
            return ban_rows, ban_ids
        allowed = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)
        for j, mask in enumerate(masks):
            allowed[j, : mask.shape[0]] = mask
        local = {row: j for j, row in enumerate(rows)}
        mine = [(local[r], t) for r, t in zip(ban_rows, ban_ids, strict=True) if r in local]
        if mine:
            tightened = allowed.clone()
            tightened[_long([j for j, _ in mine], device), _long([t for _, t in mine], device)] = (
                False
            )
            allowed = torch.where(tightened.any(dim=-1, keepdim=True), tightened, allowed)
            others = [(r, t) for r, t in zip(ban_rows, ban_ids, strict=True) if r not in local]
            ban_rows, ban_ids = [r for r, _ in others], [t for _, t in others]
        index = _long(rows, device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return ban_rows, ban_ids

    def _sample_random(
        self,
        logits: torch.Tensor,
        greedy_choice: torch.Tensor,
        request_ids: Sequence[str],
        params: Sequence[SamplingParams],
    ) -> torch.Tensor:
        """Each row's token: ``greedy_choice``'s for a greedy row, a draw for the others."""
        device = logits.device
        vocab = logits.shape[-1]
        # Every row's settings (and its uniform draw, from the host's generators) go to the
        # device in one copy, made before any of this function's kernels: on a GPU a copy
        # of pageable memory waits for the device to finish what came before it, so a copy
        # per setting, or one after the sort, would stall the step. float32 holds top_k
        # exactly (vocabularies are far below 2^24) and is the dtype each setting had.
        rows = [
            [p.temperature if not p.is_greedy else 1.0 for p in params],
            [float(p.top_k if p.top_k > 0 else vocab) for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            [
                0.0 if p.is_greedy else self._uniform(rid, p)
                for rid, p in zip(request_ids, params, strict=True)
            ],
            [1.0 if p.is_greedy else 0.0 for p in params],
        ]
        pinned = device.type == "cuda"
        settings = torch.tensor(rows, dtype=torch.float32, pin_memory=pinned)
        temperature, top_k, top_p, min_p, u, greedy = settings.to(device, non_blocking=pinned)

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

        threshold = u * cdf[:, -1]
        index = torch.searchsorted(cdf, threshold[:, None], right=True).clamp(max=vocab - 1)
        # Never land on a filtered token (possible only through float ties at the edge).
        # A row with no token kept (its logits overflowed to inf, e.g. a repetition
        # penalty near 0, so its softmax is NaN) takes its top token: clamped at 0, never
        # the -1 whose gather would fail the whole step (every request on the worker
        # aborted; on a GPU, a device assert that poisons the context).
        index = torch.minimum(index, keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
        return torch.where(greedy > 0, greedy_choice, sorted_ids.gather(1, index)[:, 0])


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first highest logit, as ``argmax(dim=-1)`` gives it, but through ``max``:
    on the CPU torch's ``argmax`` over a vocabulary is 2.6-4.6x slower (SmolLM2's 49,152
    logits, 2 cores: 2.28 vs 0.87 ms for 64 rows, 16.4 vs 3.6 ms for 256;
    bench/decode_micro.py). Both return the first index of a tie."""
    return logits.max(dim=-1).indices


def _is_plain_greedy(p: SamplingParams) -> bool:
    """Greedy with nothing that shapes the logits or reports logprobs."""
    return (
        p.is_greedy
        and not p.has_penalties
        and not p.logit_bias
        and p.min_tokens == 0
        and p.logits_processor is None
        and not p.logprobs
        and p.top_logprobs == 0
    )


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
