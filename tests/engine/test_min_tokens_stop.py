"""The engine's stop rule under min_tokens: a runner that does not mask (the simulator)
may produce a stop token early; it does not end the request before min_tokens outputs."""

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import Engine, EngineConfig, SampledToken
from kvflow.engine_worker.core.request import FinishReason
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.core.scheduler import SchedulerOutput

EOS = 3


class AlwaysEos:
    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        return {s.request.request_id: SampledToken(EOS) for s in output.scheduled if s.samples}

    def release(self, request_id: str) -> None:
        pass


def run(sampling: SamplingParams) -> tuple[list[int], FinishReason | None, int]:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64, block_size=4
        ),
        num_kv_blocks=32,
        vocab_size=50,
        eos_token_ids=(EOS,),
        hash_seed=b"seed",
    )
    engine = Engine(config, AlwaysEos())
    engine.add_request("r", [5, 6, 7], sampling)
    tokens: list[int] = []
    for _ in range(100):
        for out in engine.step():
            tokens += [t.token_id for t in out.new_tokens]
            if out.finish_reason is not None:
                return tokens, out.finish_reason, out.num_output_tokens
    raise AssertionError("did not finish")


def test_a_stop_token_before_min_tokens_does_not_stop() -> None:
    assert run(SamplingParams(max_tokens=10)) == ([], FinishReason.STOP, 1)
    assert run(SamplingParams(max_tokens=10, min_tokens=4)) == ([EOS] * 4, FinishReason.STOP, 5)
    stop_ids = SamplingParams(max_tokens=10, min_tokens=2, ignore_eos=True, stop_token_ids=(EOS,))
    assert run(stop_ids) == ([EOS] * 2, FinishReason.STOP, 3)
