"""Speculative decoding with the checkpoint's multi-token-prediction head (`--speculative mtp`, `edgemoe/engine/mtp.py`,
`edgemoe/models/mtp.py`), on a tiny Qwen3-Next checkpoint that carries a head (random weights, as the Hub's layout
names them).

The head's drafts are checked against a reference built from transformers' own Qwen3-Next classes (the decoder's
final hidden states from its model, the head's layer a transformers decoder layer loaded with the head's weights, its
norms transformers' (1 + weight) RMSNorm), teacher-forced over the whole sequence: each step's first draft is the
reference's argmax at the sequence's last position, and the chained drafts are the reference run on the chain's own
rows. Greedy output must be token-identical with speculation on and off (resident and offloaded experts), and
checkpoints without a head are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgemoe import LLM, SamplingParams
from edgemoe.engine.cuda_graphs import DecodeGraphs, default_batch_sizes
from edgemoe.errors import EdgeMoEError
from tests.conftest import hf_model, save_checkpoint
from tests.engine.test_decode_graphs import emulate_capture
from tests.engine.test_speculative import Open, generate

K = 3  # drafts a step
PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def add_head(folder, model) -> dict[str, torch.Tensor]:
    """A random head as Qwen3-Next checkpoints carry it: `mtp.fc`, its norms (stored as weight, applied as 1 +
    weight), and `mtp.layers.0`, a full-attention MoE layer (the decoder's last layer's tensors, perturbed)."""
    path, cfg = folder / "model.safetensors", model.config
    state, H = load_file(str(path)), cfg.hidden_size
    g = torch.Generator().manual_seed(11)
    head = {
        "mtp.fc.weight": torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5,
        "mtp.pre_fc_norm_embedding.weight": 0.1 * torch.randn(H, generator=g),
        "mtp.pre_fc_norm_hidden.weight": 0.1 * torch.randn(H, generator=g),
        "mtp.norm.weight": 0.1 * torch.randn(H, generator=g),
    }
    last = f"model.layers.{cfg.num_hidden_layers - 1}."
    for name, t in state.items():
        if name.startswith(last):  # the experts as they are (the checkpoint's layout is not transformers' own)
            noise = 0 if ".mlp.experts." in name else 0.05 * torch.randn(t.shape, generator=g)
            head["mtp.layers.0." + name.removeprefix(last)] = t + noise
    save_file(state | head, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))
    return head


@pytest.fixture(scope="module", params=["qwen3_next", "glm4_moe"])
def mtp_checkpoint(request, tmp_path_factory, tiny_checkpoint):
    """(folder, transformers model, reference head) of a tiny checkpoint with a head: Qwen3-Next's (4 layers, the
    last full attention), GLM-4.5's (conftest's case, its layer after the decoder's)."""
    if request.param == "glm4_moe":
        folder, model = tiny_checkpoint("glm-groups-qknorm-mtp", "per-expert")
        return folder, model, glm_reference(model, folder)
    model = hf_model("qwen3_next")
    assert model.config.layer_types[-1] == "full_attention"
    folder = save_checkpoint(model, tmp_path_factory.mktemp("qwen3next-mtp"), "per-expert")
    return folder, model, qwen3_next_reference(model, add_head(folder, model))


def qwen3_next_reference(model, head: dict[str, torch.Tensor]) -> ReferenceHead:
    """Its layer a `Qwen3NextDecoderLayer` (full attention), its norms `Qwen3NextRMSNorm` ((1 + weight)), the
    model's embedding and lm_head."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    cfg = model.config
    layer = m.Qwen3NextDecoderLayer(cfg, cfg.num_hidden_layers - 1).eval()
    own = {k.removeprefix("mtp.layers.0."): v for k, v in head.items() if ".layers." in k and ".experts." not in k}
    layer.load_state_dict(model.model.layers[-1].state_dict() | own)
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = m.Qwen3NextRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].load_state_dict({"weight": head[f"mtp.{name}.weight"]})
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    return ReferenceHead(model, layer, norms, head["mtp.fc.weight"], embed, lm_head, mask_first=False)


def glm_reference(model, folder) -> ReferenceHead:
    """Its layer a `Glm4MoeDecoderLayer` (the checkpoint's layer after the decoder's is a copy of the decoder's last,
    `tests.conftest.add_mtp_layers`), its norms `Glm4MoeRMSNorm`, its own embedding and lm_head, position 0's
    embedding zeroed (as vLLM's GLM-4.5 head)."""
    from transformers.models.glm4_moe import modeling_glm4_moe as m

    cfg, state = model.config, load_file(str(folder / "model.safetensors"))
    n = cfg.num_hidden_layers
    layer = m.Glm4MoeDecoderLayer(cfg, n - 1).eval()
    layer.load_state_dict(model.model.layers[-1].state_dict())
    norms = {}
    for ours, theirs in (("pre_fc_norm_embedding", "enorm"), ("pre_fc_norm_hidden", "hnorm"),
                         ("norm", "shared_head.norm")):  # fmt: skip
        norms[ours] = m.Glm4MoeRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[ours].load_state_dict({"weight": state[f"model.layers.{n}.{theirs}.weight"]})
    at = f"model.layers.{n}."
    fc, embed, lm_head = (state[at + k] for k in ("eh_proj.weight", "embed_tokens.weight", "shared_head.head.weight"))
    return ReferenceHead(model, layer, norms, fc, embed, lm_head, mask_first=True)


class ReferenceHead:
    """The head from transformers' own modules (a decoder layer and RMSNorms of the family's modeling file, loaded
    with the head's weights) over whole sequences at once: a causal mask, no cache."""

    def __init__(self, model, layer, norms: dict, fc, embed, lm_head, mask_first: bool) -> None:
        self.model, self.layer, self.norms = model, layer, norms
        self.fc, self.embed, self.lm_head, self.mask_first = fc, embed, lm_head, mask_first

    @torch.no_grad()
    def hidden(self, tokens: list[int]) -> torch.Tensor:
        """The decoder's final hidden states (after its final norm) [len, H]."""
        return self.model.model(torch.tensor([tokens])).last_hidden_state[0]

    @torch.no_grad()
    def run(self, hidden: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        """The head at positions 0..n-1 (hidden [n, H], next_ids [n]) -> its output [n, H] (normalised)."""
        n = hidden.shape[0]
        embedded = self.embed[torch.tensor(next_ids)]
        if self.mask_first:
            embedded[0] = 0
        embedded = self.norms["pre_fc_norm_embedding"](embedded)
        x = torch.cat([embedded, self.norms["pre_fc_norm_hidden"](hidden)], dim=-1) @ self.fc.T
        positions = torch.arange(n)[None]
        rope = self.model.model.rotary_emb(x[None], positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = self.layer(x[None], position_embeddings=rope, attention_mask=mask, position_ids=positions)
        y = y[0] if isinstance(y, tuple) else y
        return self.norms["norm"](y[0])

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """What the head drafts after `tokens` (its last token not yet computed by the decoder): the head at every
        position but the last, then k - 1 chained rows, each the previous row's output beside its predicted token."""
        hidden = self.hidden(tokens[:-1])
        rows_h, rows_t, out = hidden, list(tokens[1:]), []
        for _ in range(k):
            g = self.run(rows_h, rows_t)
            out.append(int((self.lm_head @ g[-1]).argmax()))
            rows_h, rows_t = torch.cat([rows_h, g[-1:]]), rows_t + [out[-1]]
        return out


@pytest.mark.parametrize("steered", [False, True], ids=["own-drafts", "steered-drafts"])
def test_drafts_match_transformers_reference(mtp_checkpoint, steered: bool) -> None:
    check_drafts(*mtp_checkpoint, steered, progress=False, dtype="float32", max_num_seqs=4)


def check_drafts(folder, model, ref: ReferenceHead, steered: bool, **opts) -> None:
    """After every step, the head's drafts are the reference's. Random heads' drafts all fail: `steered` replaces
    each step's drafts (once checked) with the greedy continuation, wrong from a varying position on, so that verify
    steps also keep 1 to K drafts and the head then runs over several kept positions (or, where a draft failed, over
    the positions the hybrid layers compute again)."""
    llm = LLM(str(folder), speculative="mtp", speculative_tokens=K, **opts)
    llm.engine.gate = Open()
    engine, mtp = llm.engine, llm.engine.mtp
    prompt = torch.randint(3, 400, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    want = prompt + generate(LLM(str(folder), **opts), [prompt], PARAMS)[0]
    seq = engine.add_request(prompt, PARAMS)
    checked, steps = 0, 0
    while engine.has_unfinished():
        engine.step()
        drafted = mtp.drafts.get(seq, [])
        if drafted:  # drafted after this step, from the tokens so far
            assert drafted == ref.drafts(seq.token_ids, len(drafted)), len(seq.token_ids)
            checked += 1
            if steered:
                right, steps = want[len(seq.token_ids) :][: len(drafted)], steps + 1
                wrong_from = steps % (K + 1)
                mtp.drafts[seq] = right[:wrong_from] + [(t + 1) % 400 for t in right[wrong_from:]]
    assert seq.token_ids == want and checked >= 3
    stats = engine.speculative
    assert not steered or stats.accepted > 0, stats


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
def test_greedy_identical_with_mtp(mtp_checkpoint, offload: bool) -> None:
    opts = dict(progress=False, dtype="float32", max_num_seqs=6)
    if offload:
        opts |= dict(moe_strategy="offload", moe_cache_fraction=0.5)
    check_greedy(mtp_checkpoint[0], **opts)


def check_greedy(folder, **opts) -> None:
    """Two greedy sequences and a sampled one, batched: the same tokens with the head drafting as without."""
    base = LLM(str(folder), **opts)
    spec = LLM(str(folder), speculative="mtp", speculative_tokens=K, **opts)
    spec.engine.gate = Open()
    assert spec.engine.device.type == "cpu" or spec.engine.runner.graphs is not None
    if spec.engine.device.type == "cpu":  # start-up's warm-up runs on CUDA only: the head's, in the pad block, here
        for n in (40, 17, 1):
            spec.engine.runner.warm_up(n)
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (21, 9, 30)]
    params = [PARAMS, PARAMS, SamplingParams(max_tokens=12, temperature=0.9, seed=3)]
    assert generate(spec, batch, params) == generate(base, batch, params)
    assert spec.engine.speculative.drafted > 0


def test_greedy_identical_through_decode_graphs(mtp_checkpoint) -> None:
    """Decode steps through graphs (emulated on the CPU by eager calls of the same static-buffer forward): the head
    reads the graphs' static hidden states."""
    folder = mtp_checkpoint[0]
    opts = dict(progress=False, dtype="float32", max_num_seqs=6)
    base = LLM(str(folder), **opts)
    spec = LLM(str(folder), speculative="mtp", speculative_tokens=K, **opts)
    spec.engine.gate = Open()
    graphs = DecodeGraphs(default_batch_sizes(6))
    emulate_capture(graphs, spec.engine.runner.forward_static)
    spec.engine.runner.graphs = graphs
    batch = [torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(9)).tolist() for n in (12, 25)]
    assert generate(spec, batch, PARAMS) == generate(base, batch, PARAMS)
    assert spec.engine.speculative.drafted > 0


def test_a_cached_prefix_carries_the_heads_kv(mtp_checkpoint) -> None:
    """A sampled request runs the head too (drafting nothing), so that a greedy request which the prefix cache starts
    after its prompt finds the head's K/V there: its drafts are the reference's over the whole sequence."""
    folder, _, ref = mtp_checkpoint
    llm = LLM(str(folder), progress=False, dtype="float32", max_num_seqs=4, speculative="mtp", speculative_tokens=K)
    llm.engine.gate = Open()
    engine = llm.engine
    prompt = torch.randint(3, 400, (48,), generator=torch.Generator().manual_seed(4)).tolist()  # 3 whole blocks
    generate(llm, [prompt], SamplingParams(max_tokens=4, temperature=1.0, seed=1))
    seq = engine.add_request(prompt + [7, 8], PARAMS)
    engine.step()
    assert seq.num_cached == 48, seq.num_cached  # the prompt came from the cache (a hybrid: its state snapshot too)
    drafted = engine.mtp.drafts.get(seq, [])
    assert drafted and drafted == ref.drafts(seq.token_ids, len(drafted))


@pytest.mark.parametrize("family", ["qwen3_next", "glm4_moe"])
def test_gguf_next_n_block_is_the_head(family: str, tmp_path) -> None:
    """llama.cpp's own converter writes the head as a next-n block after the decoder's (`blk.N.nextn.*` plus the
    layer's tensors; Qwen3-Next's norms with their 1 added): read from the f32 file, the drafts are the reference's,
    and greedy output is the same with and without them."""
    pytest.importorskip("gguf")
    from tests.models.llama_converter import convert
    from tests.models.test_llama_converter import CASES, GLM_TOKENS, add_special_tokens

    if family == "glm4_moe":
        model = hf_model("glm4_moe", **CASES["glm4_moe"][1])  # its MTP layer written by `save_checkpoint`
        folder = save_checkpoint(model, tmp_path / "hf", "per-expert")
        add_special_tokens(folder, GLM_TOKENS)
        ref = glm_reference(model, folder)
    else:
        model = hf_model("qwen3_next")
        folder = save_checkpoint(model, tmp_path / "hf", "per-expert")
        ref = qwen3_next_reference(model, add_head(folder, model))
    path = convert(folder, tmp_path / f"{family}.gguf")
    check_drafts(path, model, ref, True, progress=False, dtype="float32", max_num_seqs=4)
    check_greedy(path, progress=False, dtype="float32", max_num_seqs=6)


def test_checkpoints_without_a_head_are_refused(tiny_checkpoint) -> None:
    with pytest.raises(EdgeMoEError, match="no multi-token-prediction head that edgemoe reads"):
        LLM(progress=False, speculative="mtp")
    folder, _ = tiny_checkpoint("qwen3next-dense", "per-expert")
    with pytest.raises(EdgeMoEError, match="no multi-token-prediction head .no mtp_num_hidden_layers"):
        LLM(str(folder), progress=False, speculative="mtp")
    folder, _ = tiny_checkpoint("glm-air-dense2", "per-expert")
    with pytest.raises(EdgeMoEError, match="no multi-token-prediction layer .num_nextn_predict_layers is 0"):
        LLM(str(folder), progress=False, speculative="mtp")
