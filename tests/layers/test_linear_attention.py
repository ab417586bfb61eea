"""The Gated DeltaNet references against transformers' own (Qwen3-Next's modeling file: its plain-torch chunked and
recurrent gated delta rule and causal convolutions), on fresh random inputs: bitwise where the order of operations
is the same, and a sequence cut into prefill chunks equal to it whole."""

from __future__ import annotations

import pytest
import torch

from edgemoe.layers.linear_attention import causal_conv, chunked_delta_rule, conv_step, recurrent_step

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def inputs(seed: int, tokens: int, k_heads: int = 2, v_heads: int = 4, k_dim: int = 16, v_dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, k_heads, k_dim, generator=g) for _ in range(2))
    v = torch.randn(tokens, v_heads, v_dim, generator=g)
    decay = -torch.rand(tokens, v_heads, generator=g) * 2  # log decay <= 0
    beta = torch.rand(tokens, v_heads, generator=g)
    state = torch.randn(v_heads, k_dim, v_dim, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("tokens", [1, 37, 64, 150])
def test_chunked_rule_is_transformers(tokens: int) -> None:
    q, k, v, g, beta, state = inputs(tokens, tokens)
    ref, ref_state = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    out, new_state = chunked_delta_rule(q, k, v, g, beta, state)
    assert torch.equal(out, ref[0]) and torch.equal(new_state, ref_state[0])


def test_prefill_chunks_carry_the_state() -> None:
    q, k, v, g, beta, state = inputs(1, 150)
    whole, whole_state = chunked_delta_rule(q, k, v, g, beta, state)
    outs, s = [], state
    for a, b in ((0, 5), (5, 70), (70, 150)):
        o, s = chunked_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole, atol=2e-5, rtol=0)
    torch.testing.assert_close(s, whole_state, atol=2e-5, rtol=0)


def test_an_empty_sequence_leaves_the_state() -> None:
    """No tokens (a padded batch's empty sequence, as the prefill kernel's graph test replays): no output rows, and
    the state is the one given, as transformers' rule keeps it."""
    q, k, v, g, beta, state = inputs(3, 0)
    out, new_state = chunked_delta_rule(q, k, v, g, beta, state)
    assert out.shape == (0, 4, 8) and out.dtype == v.dtype and torch.equal(new_state, state)
    q1, k1, v1, g1, beta1, _ = inputs(3, 1)
    _, ref_state = hf.torch_recurrent_gated_delta_rule(
        q1[None, :0], k1[None, :0], v1[None, :0], g1[None, :0], beta1[None, :0], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    assert torch.equal(ref_state[0], state)


def test_recurrent_step_is_transformers_and_the_chunked_rule() -> None:
    q, k, v, g, beta, state = inputs(2, 6)
    states = torch.stack([state, state.flip(0), state * 0.5, state.neg()])  # 4 sequences, one token each
    ref_out, ref_states = [], []
    for i in range(4):
        o, s = hf.torch_recurrent_gated_delta_rule(
            q[None, i : i + 1], k[None, i : i + 1], v[None, i : i + 1], g[None, i : i + 1], beta[None, i : i + 1],
            initial_state=states[i : i + 1], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        ref_out.append(o[0, 0])
        ref_states.append(s[0])
    out, new = recurrent_step(q[:4], k[:4], v[:4], g[:4], beta[:4], states)
    assert torch.equal(out, torch.stack(ref_out)) and torch.equal(new, torch.stack(ref_states))
    one, _ = chunked_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], states[0])
    torch.testing.assert_close(out[0], one[0], atol=1e-5, rtol=0)


def test_convolutions_are_transformers() -> None:
    g = torch.Generator().manual_seed(3)
    channels, kernel, tokens = 12, 4, 9
    weight = torch.randn(channels, 1, kernel, generator=g)
    x = torch.randn(tokens, channels, generator=g)
    out, state = causal_conv(x, torch.zeros(channels, kernel - 1), weight)
    ref = hf.causal_conv1d_fn(x.t()[None], weight[:, 0], None, activation="silu")[0].t()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    assert torch.equal(state, x[-(kernel - 1) :].t())
    step = torch.randn(2, channels, generator=g)
    states = torch.stack([state, torch.randn(channels, kernel - 1, generator=g)])
    out, new = conv_step(step, states, weight)
    for i in range(2):
        hf_state = states[i : i + 1].clone()
        ref = hf.causal_conv1d_update(step[i : i + 1, :, None], hf_state, weight[:, 0], None, activation="silu")
        torch.testing.assert_close(out[i], ref[0, :, 0], atol=1e-6, rtol=0)
        assert torch.equal(new[i], hf_state[0])
