"""The Python API: `LLM(...).generate(prompts, SamplingParams(...))` and `.chat(messages, ...)`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from edgemoe.config import engine_config
from edgemoe.engine.engine import LLMEngine
from edgemoe.engine.sequence import RequestOutput
from edgemoe.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Offline inference. `model=None` loads the bundled demo model; keyword arguments are `EngineConfig` fields
    (device, dtype, max_num_seqs, kv_cache_memory, ...) and `ExpertCacheConfig` fields (moe_strategy, ...).

    Defaults: up to 8 sequences at a time; a KV cache with room for 8 sequences of the model's context, within 80 %
    of the free GPU memory or 1 GiB on the CPU (it says what it took on stderr; `kv_cache_tokens`, `kv_cache_memory`,
    `max_model_len` or `max_num_seqs` make it smaller); requests without a seed sample differently per `LLM` unless
    `seed=` is given."""

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "auto", **kwargs) -> None:
        self.engine = LLMEngine(engine_config(model=model, device=device, dtype=dtype, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([(p, False) for p in prompts], params or SamplingParams())

    def chat(
        self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (or a list of them) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([(c, True) for c in convs], params or SamplingParams())

    def moe_stats(self) -> dict:
        """Expert-cache counters per MoE layer and in total (needs moe_strategy="offload", moe_collect_stats=True)."""
        return self.engine.moe_stats()

    def stream(
        self, prompt: Prompt | list[dict], params: SamplingParams | None = None, chat: bool = False
    ) -> Iterator[RequestOutput]:
        """Yield outputs for one request as it advances; each carries the new text in `.delta`."""
        seq = self.engine.add_request(prompt, params or SamplingParams(), chat=chat)
        try:
            while seq.finish_reason is None:
                for out in self.engine.step():
                    if out.request_id == seq.request_id:
                        yield out
        finally:
            if seq.finish_reason is None:
                self.engine.abort(seq.request_id)

    def _run(self, requests: list[tuple], params: SamplingParams) -> list[RequestOutput]:
        seqs = []
        try:
            for prompt, chat in requests:
                seqs.append(self.engine.add_request(prompt, params, chat=chat))
            while any(s.finish_reason is None for s in seqs):
                self.engine.step()
        except BaseException:
            for s in seqs:
                self.engine.abort(s.request_id)
            raise
        return [s.output() for s in seqs]
