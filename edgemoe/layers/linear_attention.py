"""The Gated DeltaNet layer of the hybrid families (Qwen3-Next, Qwen3.5/3.6 MoE): linear attention whose memory of the
past is a fixed-size state per sequence instead of a growing KV cache.

Per token: q, k, v (and an output gate z, a write strength beta, a decay rate a) are projected from the layer's input;
q, k, v pass a causal depthwise convolution over the last `kernel` tokens (its state: the previous kernel - 1 inputs)
and SiLU; q and k are L2-normalised; then, per value head, a matrix state S [k_dim, v_dim] decays by exp(g) and is
corrected towards v along k (the delta rule: S += k (x) beta (v - k^T S)), and the output reads it along q. The output
is RMS-normalised per head, gated by SiLU(z) and projected back.

Each sequence's two states (the convolution's inputs, the fp32 matrix per head) live in a pool of slots that
`edgemoe.engine.state_cache.StateCache` binds (`state_shapes`, `bind_state`); the step's slot per sequence comes in
the forward context (`state_slots`). A slot starts at zero with its sequence. Prefill runs each sequence's new tokens
through `chunked_delta_rule` from its slot's state; decode runs one `recurrent_step` for the whole batch, gathered from
and scattered back to the slots: fixed shapes and no host reads, so CUDA graphs capture it. Both are plain torch here,
the references of the kernels that replace them (`use_kernels`): on CUDA decode runs `edgemoe.kernels.gated_delta`
(two launches on the slots in place) and prefill's delta rule `edgemoe.kernels.gated_delta_prefill` (two launches for
the whole batch, the slots in place); prefill's convolution stays torch's conv1d, one call a sequence.

Grouped heads: a q/k head serves `v_heads // k_heads` value heads: consecutive ones in the Hugging Face checkpoints'
order, every `k_heads`-th one in the order llama.cpp's converter writes Qwen3.5 GGUF files in (`tiled`: value head h
reads q/k head h % k_heads). Every value-head tensor (v, z, b, a, A, dt_bias, the convolution's v channels, out_proj's
columns) follows the one order, so only the pairing with q/k heads differs.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.context import get_context
from edgemoe.layers.linear import DecodeLinear

L2_EPS = 1e-6  # q and k are divided by sqrt(sum of squares + L2_EPS)
CHUNK = 64  # tokens the chunked delta rule solves at once


class GatedDeltaNet(nn.Module):
    """Parameters under the Qwen3.5 names: in_proj_qkv (q, k, v rows: every q head, then every k head, then every
    value head), in_proj_z, in_proj_b and in_proj_a (or, `fused_ba`, Qwen3-Next's in_proj_ba: per q/k head its value
    heads' b rows then their a rows), conv1d (depthwise: weight [channels, 1, kernel]), dt_bias, A, norm, out_proj.

    A is the per-head decay rate as llama.cpp stores it (`ssm_a`), -exp(A_log) of the Hugging Face checkpoints (the
    family converts), kept in fp32 as transformers computes it. (Qwen3-Next's checkpoints interleave q, k, v, z per
    key head in one in_proj_qkvz: its family file splits them.) `tiled`: the value heads' order (module docstring)."""

    float32_parameters = ("A",)  # the loader keeps it fp32 whatever the model's dtype (`keep_float32`)
    splits_by_head = True  # tensor parallelism: each rank its q/k heads' share, out_proj's sum over the ranks

    def __init__(
        self,
        hidden: int,
        k_heads: int,
        v_heads: int,
        k_dim: int,
        v_dim: int,
        kernel: int,
        eps: float,
        fused_ba: bool = False,
        tiled: bool = False,
    ) -> None:
        super().__init__()
        if v_heads % k_heads:
            raise ValueError(f"linear_num_value_heads {v_heads} is not a multiple of linear_num_key_heads {k_heads}")
        self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.kernel = k_heads, v_heads, k_dim, v_dim, kernel
        self.tiled = tiled
        self.qkv_sizes = [k_heads * k_dim, k_heads * k_dim, v_heads * v_dim]
        self.channels = sum(self.qkv_sizes)
        self.in_proj_qkv = DecodeLinear(hidden, self.channels, bias=False)
        self.in_proj_z = DecodeLinear(hidden, v_heads * v_dim, bias=False)
        if fused_ba:
            self.in_proj_ba = DecodeLinear(hidden, 2 * v_heads, bias=False)
        else:
            self.in_proj_b = DecodeLinear(hidden, v_heads, bias=False)
            self.in_proj_a = DecodeLinear(hidden, v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.channels, self.channels, kernel, groups=self.channels, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(v_heads))
        self.A = nn.Parameter(torch.empty(v_heads))
        self.norm = GatedRMSNorm(v_dim, eps)
        self.out_proj = DecodeLinear(v_heads * v_dim, hidden, bias=False)
        # the state cache binds these (`bind_state`): [slots, channels, kernel - 1] and [slots, v_heads, k_dim, v_dim]
        self.conv_state = torch.empty(0)
        self.recurrent_state = torch.empty(0)
        self._decode_kernel = None  # `edgemoe.kernels.gated_delta.gated_delta_decode`, once `use_kernels` chose it
        self._prefill_kernel = None  # `edgemoe.kernels.gated_delta_prefill.delta_rule_prefill`, likewise
        self._joined: list[DecodeLinear] = []  # decode's input projections as one (`join_projections`; unregistered)
        self._join_sizes: list[int] = []

    def state_shapes(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One sequence's states: the convolution's last inputs (the model's dtype) and the delta rule's matrices
        (fp32, as transformers keeps them)."""
        return [
            ((self.channels, self.kernel - 1), dtype),
            ((self.v_heads, self.k_dim, self.v_dim), torch.float32),
        ]

    def bind_state(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv_state, self.recurrent_state = conv, recurrent

    def use_kernels(self, device: torch.device) -> None:
        if max(self.k_dim, self.v_dim) <= 256:  # the kernels hold a [k_dim, block of v_dim] tile in registers
            from edgemoe.kernels.gated_delta import gated_delta_decode
            from edgemoe.kernels.gated_delta_prefill import delta_rule_prefill

            self._decode_kernel = gated_delta_decode  # 2 launches, the states updated in place, instead of ~45
            self._prefill_kernel = delta_rule_prefill  # 2 launches a batch instead of ~10 a chunk of each sequence
        if self.join_projections():
            self._joined[0].use_kernels(device)

    def _projections(self) -> list[nn.Module]:
        return [self.in_proj_qkv, self.in_proj_z, *self._ba_projections()]

    def _ba_projections(self) -> list[nn.Module]:
        return [self.in_proj_ba] if hasattr(self, "in_proj_ba") else [self.in_proj_b, self.in_proj_a]

    def join_projections(self) -> bool:
        """Decode's input projections (qkv, z, then b and a, or ba) as one weight, so that a decode step runs one GEMV
        where it ran three or four (each row computed alike: the GEMV is row-invariant); the projections' weights
        become views of it (no memory added). Only where all are float `DecodeLinear`s of one dtype (a GGUF file's
        quantized ones keep theirs). -> whether they are joined."""
        parts = self._projections()
        if self._joined or any(type(p) is not DecodeLinear or p.bias is not None for p in parts):
            return bool(self._joined)
        if len({p.weight.dtype for p in parts}) != 1 or any(p.weight.is_meta for p in parts):
            return False
        weight = torch.cat([p.weight.detach() for p in parts])  # [rows, hidden]
        start = 0
        for p in parts:
            p.weight = nn.Parameter(weight[start : start + p.out_features], requires_grad=False)
            start += p.out_features
        with torch.device("meta"):  # no init: its weight is the joined one
            joined = DecodeLinear(weight.shape[1], weight.shape[0], bias=False)
        joined.weight = nn.Parameter(weight, requires_grad=False)
        self._joined, self._join_sizes = [joined], [p.out_features for p in parts]
        return True

    def fuses_norm(self, *args) -> bool:
        """`DecoderLayer` asks every token mixer; this one runs its input norm apart."""
        return False

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden] (normed) -> [tokens, hidden]. Positions are not used: the state carries the order."""
        ctx = get_context()
        if self._joined and not ctx.is_prefill:  # one GEMV for all four (`join_projections`)
            mixed, z, *ba = self._joined[0](x).split(self._join_sizes, dim=-1)
            b, a = self._split_ba(*ba)
        else:
            mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)
            b, a = self._split_ba(*(p(x) for p in self._ba_projections()))
        if ctx.is_prefill:
            out = self._prefill(mixed, *self.gates(b, a), ctx)
        elif self._decode_kernel is not None:  # the gates computed inside
            out = self._decode_kernel(
                mixed, b, a, self.A, self.dt_bias, ctx.state_slots, self.conv1d.weight, self.conv_state,
                self.recurrent_state, self.k_heads, self.tiled,
            )  # fmt: skip
        else:
            out = self._decode(mixed, *self.gates(b, a), ctx.state_slots)
        out = self.norm(out.reshape(-1, self.v_dim), z.reshape(-1, self.v_dim))
        return self.out_proj(out.reshape(x.shape[0], -1))

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The projections' b, a [tokens, v_heads] -> beta (sigmoid, b's dtype) and the log decay g (fp32, <= 0)."""
        return torch.sigmoid(b), self.A * F.softplus(a.float() + self.dt_bias)

    def _split_ba(self, *outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The b and a projections' outputs -> b, a [tokens, v_heads]: two outputs, or one whose rows are per q/k head
        its value heads' b then their a (`in_proj_ba`)."""
        if len(outputs) == 2:
            return outputs
        tokens = outputs[0].shape[0]
        b, a = outputs[0].reshape(tokens, self.k_heads, -1).chunk(2, dim=-1)
        return b.reshape(tokens, -1), a.reshape(tokens, -1)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved channels [tokens, channels] -> q, k [tokens, k_heads, k_dim] (tiled: [tokens, v_heads, k_dim],
        each value head's own), v [tokens, v_heads, v_dim]."""
        q, k, v = mixed.split(self.qkv_sizes, dim=-1)
        n = mixed.shape[0]
        q, k, v = q.reshape(n, -1, self.k_dim), k.reshape(n, -1, self.k_dim), v.reshape(n, -1, self.v_dim)
        if self.tiled:  # value head h reads q/k head h % k_heads
            r = self.v_heads // self.k_heads
            q, k = q.repeat(1, r, 1), k.repeat(1, r, 1)
        return q, k, v

    def _prefill(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, ctx) -> torch.Tensor:
        """Each sequence's new tokens from its slot's states: the convolution one sequence at a time, then the delta
        rule for the batch (`delta_rule_prefill`) or, in plain torch, one sequence at a time (`chunked_delta_rule`)."""
        convolved, start = [], 0
        for i, n in enumerate(ctx.query_lens):
            slot = ctx.state_slots[i : i + 1]
            conv = self.conv_state.index_select(0, slot)[0]
            channels, conv = causal_conv(mixed[start : start + n], conv, self.conv1d.weight)
            self.conv_state.index_copy_(0, slot, conv[None].to(self.conv_state.dtype))
            convolved.append(channels)
            start += n
        channels = torch.cat(convolved)  # [tokens, channels]
        if self._prefill_kernel is not None:
            cu_seqlens = torch.tensor([0, *itertools.accumulate(ctx.query_lens)], dtype=torch.int32)
            return self._prefill_kernel(
                channels, beta, g, self.recurrent_state, ctx.state_slots, cu_seqlens.to(mixed.device),
                max(ctx.query_lens), self.k_heads, self.tiled,
            )  # fmt: skip
        q, k, v = self._heads(channels)
        outs, start = [], 0
        for i, n in enumerate(ctx.query_lens):
            slot = ctx.state_slots[i : i + 1]
            state = self.recurrent_state.index_select(0, slot)[0]
            o, state = chunked_delta_rule(*(t[start : start + n] for t in (q, k, v, g, beta)), state)
            self.recurrent_state.index_copy_(0, slot, state[None])
            outs.append(o)
            start += n
        return torch.cat(outs)

    def _decode(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The decode step in plain torch: the reference of `gated_delta_decode`."""
        conv = self.conv_state.index_select(0, slots)
        channels, conv = conv_step(mixed, conv, self.conv1d.weight)
        self.conv_state.index_copy_(0, slots, conv.to(self.conv_state.dtype))
        q, k, v = self._heads(channels)
        out, state = recurrent_step(q, k, v, g, beta, self.recurrent_state.index_select(0, slots))
        self.recurrent_state.index_copy_(0, slots, state)
        return out


class GatedRMSNorm(nn.Module):
    """RMSNorm per value head, then the output gate: weight * norm(x) * SiLU(z) (the norm's product in x's dtype, the
    gate's in fp32, as transformers' Qwen3-Next computes it)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._kernel = None  # `edgemoe.kernels.norm_rope.gated_rms_norm`, once `use_kernels` chose it

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.norm_rope import gated_rms_norm

        self._kernel = gated_rms_norm  # one launch instead of ~12

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            return self._kernel(x, z, self.weight, self.eps)
        return self.reference(x, z)

    def reference(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`forward` in plain torch, whatever kernel was chosen: the kernel's oracle."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's depthwise causal convolution and SiLU over its new tokens, after the inputs in `state`.
    x: [tokens, channels]; state: [channels, kernel - 1]; weight: [channels, 1, kernel] -> (out [tokens, channels],
    the new state: the last kernel - 1 inputs)."""
    full = torch.cat((state.to(x.dtype), x.t()), dim=1)  # [channels, kernel - 1 + tokens]
    out = F.conv1d(full[None], weight, groups=weight.shape[0])[0]  # [channels, tokens]
    return F.silu(out).t(), full[:, full.shape[1] - state.shape[1] :]


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv` of one token for each sequence of a batch. x: [seqs, channels]; state: [seqs, channels,
    kernel - 1] -> (out [seqs, channels], new states)."""
    full = torch.cat((state.to(x.dtype), x[:, :, None]), dim=2)  # [seqs, channels, kernel]
    out = F.conv1d(full, weight, groups=weight.shape[0])[:, :, 0]
    return F.silu(out), full[:, :, 1:]


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """fp32 [v_heads, tokens, dim] per head: q and k L2-normalised (q also by sqrt(k_dim)) and repeated to serve
    their value heads; g and beta [v_heads, tokens]."""
    groups = v.shape[1] // k.shape[1]
    q, k = (t.float().repeat_interleave(groups, dim=1).transpose(0, 1) for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    q = q * q.shape[-1] ** -0.5
    return q, k, v.float().transpose(0, 1), g.float().t(), beta.float().t()


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for each sequence of a batch (decode).
    q, k: [seqs, k_heads, k_dim]; v: [seqs, v_heads, v_dim]; g, beta: [seqs, v_heads]; state: [seqs, v_heads, k_dim,
    v_dim] fp32 -> (out [seqs, v_heads, v_dim] in v's dtype, the new states)."""
    groups = v.shape[1] // k.shape[1]
    q, k = (t.float().repeat_interleave(groups, dim=1) for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    q = q / q.shape[-1] ** 0.5  # (divided, where the chunked rule multiplies: each as transformers rounds it)
    state = state * g.float().exp()[..., None, None]
    predicted = (state * k[..., None]).sum(-2)  # k^T S: [seqs, v_heads, v_dim]
    delta = (v.float() - predicted) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2).to(v.dtype), state


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's tokens from `state`, `chunk` tokens solved at once (prefill).
    q, k: [tokens, k_heads, k_dim]; v: [tokens, v_heads, v_dim]; g, beta: [tokens, v_heads]; state: [v_heads, k_dim,
    v_dim] fp32 -> (out [tokens, v_heads, v_dim] in v's dtype, the state after the last token).

    Within a chunk, with G_t the decay summed from the chunk's start to t and S0 the state before it, the corrections
    d_t = beta_t (v_t - k_t^T S_(t-1)) satisfy a unit lower-triangular system (I + A) d = beta (v - e^G K S0), with
    A[t, s] = beta_t e^(G_t - G_s) k_t . k_s for s < t: one triangular solve a chunk instead of a step a token. Then
    o_t = e^(G_t) q_t^T S0 + sum_(s <= t) e^(G_t - G_s) (q_t . k_s) d_s, and the chunk's last state follows alike."""
    n, dtype = q.shape[0], v.dtype
    if n == 0:  # an empty sequence (a padded batch's): no output, the state as it was
        return v.new_zeros(v.shape), state
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = -n % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    heads, chunks = q.shape[0], (n + pad) // chunk
    q, k, v = (t.reshape(heads, chunks, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(heads, chunks, chunk), beta.reshape(heads, chunks, chunk)
    G = g.cumsum(-1)  # [heads, chunks, chunk]
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # s > t: not yet written
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(later, float("-inf")).exp()  # e^(G_t - G_s), s <= t
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay  # its strict lower triangle is A; the solve takes a unit diagonal
    corrections = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, kb * G.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # s <= t
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for c in range(chunks):
        d = corrections[:, c] - reads[:, c] @ state  # [heads, chunk, v_dim]
        out[:, c] = q_decayed[:, c] @ state + attn[:, c] @ d
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ d
    out = out.reshape(heads, chunks * chunk, -1)[:, :n].transpose(0, 1)
    return out.to(dtype), state
