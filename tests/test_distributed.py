"""Context parallelism without a GPU: the merge math (``distributed.merge_local``)
against an fp64 attention over the whole sequence, the collectives (``cp_merge``,
``cp_decode``) on gloo with 2 and 4 CPU processes, the shard layout, the keywords'
validation and their compile keys."""

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_reference import query_positions, shard_attention_ref
from flash_attn_cute import distributed
from flash_attn_cute.distributed import merge_local, shard_length, shard_positions

WORLDS = (2, 4)


def _case(seed, seqlen_k, seqlen_q=1, heads=8, heads_kv=2, d=16, batch=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, d, generator=g)
    k = torch.randn(batch, seqlen_k, heads_kv, d, generator=g)
    v = torch.randn(batch, seqlen_k, heads_kv, d, generator=g)
    return q, k, v


def _shard_partials(q, k, v, world, interleave, causal, window, seqlens):
    """Each rank's (out (tokens, heads, d) fp32, lse (tokens, heads)) over its shard, from
    the fp64 reference (the kernels' part, exact here), and the whole-cache reference."""
    batch, seqlen_q = q.shape[:2]
    outs, lses = [], []
    for r in range(world):
        o_r, l_r = [], []
        for b in range(batch):
            n = seqlens[b]
            pos = shard_positions(n, world, r, interleave)
            o, l = shard_attention_ref(q[b], k[b, pos], v[b, pos], query_positions(n, seqlen_q), pos,
                                       causal=causal, window=window)
            o_r.append(o), l_r.append(l)
        outs.append(torch.cat(o_r).float()), lses.append(torch.cat(l_r).float())
    whole = [shard_attention_ref(q[b], k[b, :seqlens[b]], v[b, :seqlens[b]],
                                 query_positions(seqlens[b], seqlen_q), torch.arange(seqlens[b]),
                                 causal=causal, window=window) for b in range(batch)]
    return outs, lses, torch.cat([w[0] for w in whole]), torch.cat([w[1] for w in whole])


def _by_rank_heads(x, world, r):
    h = x.shape[1]
    return x[:, r * h // world:(r + 1) * h // world]


@pytest.mark.parametrize("op", distributed.OPS)
@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 1), (4, 3), (8, 2)])
@pytest.mark.parametrize("causal,window,seqlen_q", [(False, (-1, -1), 1), (True, (-1, -1), 4),
                                                    (False, (5, 0), 4), (True, (-1, -1), 1)])
def test_merge_local_is_whole_attention(op, world, interleave, causal, window, seqlen_q):
    """Shards merged = one attention over the whole cache (fp32 partials: to fp32 rounding),
    with short sequences whose last ranks hold no key (lse -inf, out 0 there)."""
    q, k, v = _case(world * 7 + interleave, 37, seqlen_q, batch=3)
    seqlens = [37, 3, 1]  # with world 4 / 8 the shards of the last two are partly empty
    outs, lses, ref_out, ref_lse = _shard_partials(q, k, v, world, interleave, causal, window, seqlens)
    assert any(bool(torch.isinf(l).all(dim=1).any()) for l in lses)  # some rank holds no key of some row
    for layout in ("tokens_heads", "heads_tokens"):
        given = lses if layout == "tokens_heads" else [l.t() for l in lses]
        merged = merge_local(outs, given, op=op, return_lse=True, lse_layout=layout)
        for r, (o, l) in enumerate(merged):
            l = l if layout == "tokens_heads" else l.t()
            torch.testing.assert_close(o.double(), _by_rank_heads(ref_out, world, r), atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(l.double(), _by_rank_heads(ref_lse, world, r), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("op", distributed.OPS)
def test_merge_local_adds_the_sink_once(op):
    world, heads = 4, 8
    q, k, v = _case(3, 21, 2, heads=heads)
    outs, lses, _, _ = _shard_partials(q, k, v, world, 1, True, (-1, -1), [21])
    sink = torch.randn(heads)
    whole_s = torch.einsum("qhd,khd->hqk", q[0].double(), k[0].double().repeat_interleave(4, 1)) * 16 ** -0.5
    rel = torch.arange(21)[None, :] - query_positions(21, 2)[:, None]
    whole_s = whole_s.masked_fill((rel > 0)[None], -math.inf)
    logits = torch.cat([whole_s, sink.double()[:, None, None].expand(heads, 2, 1)], dim=-1)
    lse = torch.logsumexp(logits, -1)
    p = torch.exp(whole_s - lse[..., None])
    ref = torch.einsum("hqk,khd->qhd", p, v[0].double().repeat_interleave(4, 1))
    for r, (o, l) in enumerate(merge_local(outs, lses, op=op, return_lse=True, learnable_sink=sink)):
        torch.testing.assert_close(o.double(), _by_rank_heads(ref, world, r), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(l.double(), _by_rank_heads(lse.t(), world, r), atol=2e-5, rtol=2e-5)


def test_every_rank_empty_gives_zeros_and_minus_inf():
    outs = [torch.zeros(3, 4, 8) for _ in range(2)]
    lses = [torch.full((3, 4), -math.inf) for _ in range(2)]
    for op in distributed.OPS:
        for o, l in merge_local(outs, lses, op=op, return_lse=True):
            assert torch.equal(o, torch.zeros_like(o)) and bool(torch.isneginf(l).all())


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("interleave", [1, 2, 16])
def test_shard_layout(world, interleave):
    """The shards partition the sequence, in increasing order, and shard_length counts them."""
    for n in (0, 1, 5, 64, 100):
        parts = [shard_positions(n, world, r, interleave) for r in range(world)]
        assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(n))
        for r, p in enumerate(parts):
            assert shard_length(n, world, r, interleave) == p.numel()
            assert bool((p[1:] > p[:-1]).all())
            if interleave == 1 and p.numel():  # the FA3 fork's map: local j -> j * world + rank
                assert torch.equal(p, torch.arange(p.numel()) * world + r)
        lengths = shard_length(torch.tensor([n, n + 1]), world, 0, interleave)
        assert lengths.tolist() == [parts[0].numel(), shard_positions(n + 1, world, 0, interleave).numel()]


def test_merge_argument_errors():
    out, lse = torch.zeros(3, 4, 8), torch.zeros(3, 4)
    with pytest.raises(ValueError, match="op must be"):
        merge_local([out, out], [lse, lse], op="ring")
    with pytest.raises(ValueError, match="multiple of the group"):
        merge_local([out] * 3, [lse] * 3)
    with pytest.raises(ValueError, match="lse must have shape"):
        merge_local([out, out], [lse.t(), lse.t()])
    with pytest.raises(ValueError, match="float32"):
        merge_local([out, out], [lse.half(), lse.half()])
    with pytest.raises(ValueError, match="learnable_sink must have shape"):
        merge_local([out, out], [lse, lse], learnable_sink=torch.zeros(3))


# ------------------------------------------------------------------ gloo, CPU processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_kvcache(q, k_cache, v_cache, *, cache_seqlens, causal, window_size, cp_world_size, cp_rank,
                  cp_tot_seqused_k, cp_kv_interleave, return_lse, **_):
    """``flash_attn_with_kvcache`` on CPU tensors (the kernels need a GPU): the fp64
    reference with the ``cp_*`` keywords' semantics, out and lse as the kernels return them."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        n, tot = int(cache_seqlens[b]), int(cp_tot_seqused_k[b]) if cp_tot_seqused_k is not None else None
        tot = n if tot is None else tot
        pos = shard_positions(tot, cp_world_size, cp_rank, cp_kv_interleave)
        assert pos.numel() == n
        o, l = shard_attention_ref(q[b], k_cache[b, :n], v_cache[b, :n], query_positions(tot, q.shape[1]), pos,
                                   causal=causal, window=window_size)
        outs.append(o.float()), lses.append(l.t().float())
    return torch.stack(outs), torch.stack(lses)


def _worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import flash_attn_cute.interface as interface

        interface.flash_attn_with_kvcache = _fake_kvcache  # cp_decode imports it by name at call time
        heads, d, seqlen_q, tot = 4 * world, 16, 3, [29, 2]
        q, k, v = _case(11, 29, seqlen_q, heads=heads, heads_kv=2, d=d, batch=2)
        report = {}
        # cp_merge over gloo == merge_local of the same partials (the same code after the exchange)
        outs, lses, ref_out, ref_lse = _shard_partials(q, k, v, world, 2, True, (-1, -1), tot)
        local = merge_local(outs, lses, op="ag_rs", return_lse=True)
        for op in distributed.OPS:
            o, l = distributed.cp_merge(outs[rank], lses[rank].t(), op=op, return_lse=True,
                                        lse_layout="heads_tokens")
            report[f"merge_{op}"] = (float((o - local[rank][0]).abs().max()),
                                     float((l.t() - local[rank][1]).nan_to_num(0).abs().max()),
                                     float((o.double() - _by_rank_heads(ref_out, world, rank)).abs().max()))
        # with a sink: each rank adds its heads' (ag_rs after the reduce-scatter, a2a in the combine)
        sink = torch.randn(heads, generator=torch.Generator().manual_seed(5))
        for op in distributed.OPS:
            want = merge_local(outs, lses, op=op, return_lse=True, learnable_sink=sink)[rank]
            o, l = distributed.cp_merge(outs[rank], lses[rank], op=op, return_lse=True,
                                        learnable_sink=sink[rank * 4:(rank + 1) * 4])
            report[f"sink_{op}"] = (float((o - want[0]).abs().max()), float((l - want[1]).nan_to_num(0).abs().max()))
        # cp_decode: gather this rank's heads, attend the shard, merge
        cap = 32
        shard_k = torch.zeros(2, cap, 2, d)
        shard_v = torch.zeros(2, cap, 2, d)
        lengths = []
        for b, n in enumerate(tot):
            pos = shard_positions(n, world, rank, 2)
            shard_k[b, :pos.numel()], shard_v[b, :pos.numel()] = k[b, pos], v[b, pos]
            lengths.append(pos.numel())
        mine = q[:, :, rank * 4:(rank + 1) * 4]
        for op in distributed.OPS:
            o, l = distributed.cp_decode(mine, shard_k, shard_v, cache_seqlens=torch.tensor(lengths),
                                         cp_tot_seqused_k=torch.tensor(tot), causal=True, cp_kv_interleave=2,
                                         op=op, return_lse=True)
            ref = ref_out.view(2, seqlen_q, heads, d)[:, :, rank * 4:(rank + 1) * 4]
            ref_l = ref_lse.view(2, seqlen_q, heads)[:, :, rank * 4:(rank + 1) * 4].permute(0, 2, 1)
            report[f"decode_{op}"] = (tuple(o.shape), float((o.double() - ref).abs().max()),
                                      float((l.double() - ref_l).nan_to_num(0).abs().max()))  # -inf == -inf
        results[rank] = report
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", WORLDS)
def test_gloo_cp_merge_and_cp_decode(world):
    """``cp_merge`` (both ops) and ``cp_decode`` on ``world`` gloo processes: the merge is
    ``merge_local``'s to fp32 rounding and the whole attention's; cp_decode returns the
    rank's heads of the whole-cache attention."""
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, _free_port(), results), nprocs=world, join=True)
    assert len(results) == world
    for rank, report in results.items():
        for op in distributed.OPS:
            d_local, d_lse, d_ref = report[f"merge_{op}"]
            assert d_local <= 1e-5 and d_lse <= 1e-5 and d_ref <= 5e-5, (rank, op, report)
            assert max(report[f"sink_{op}"]) <= 1e-5, (rank, op, report)
            shape, d_out, d_l = report[f"decode_{op}"]
            assert shape == (2, 3, 4, 16) and d_out <= 5e-5 and d_l <= 5e-5, (rank, op, report)


# ------------------------------------------------------------ the keywords, on CPU tensors


def _kvcache_call(backend, **cp):
    import flash_attn_cute as fac

    b, sq, h, hkv, d, cap = 2, 4, 8, 2, 128, 256
    q = torch.randn(b, sq, h, d, dtype=torch.bfloat16)
    kc = torch.randn(b, cap, hkv, d, dtype=torch.bfloat16)
    sl = torch.full((b,), 100, dtype=torch.int32)
    return fac.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=sl, backend=backend, num_splits=1, **cp)


@pytest.mark.parametrize("backend,arch", [("sm80", "sm_90a"), ("sm90", "sm_90a"), ("sm100", "sm_100a")])
def test_cp_keys(backend, arch):
    """A causal or windowed shard compiles the ContextParallel variant ("cp" in the key's
    flags; rank, world and interleave at run time: one kernel for every rank); without a
    mask, or with one rank, the key is the plain call's."""
    from feature_pairs import fake_gpu_calls

    tot = torch.full((2,), 400, dtype=torch.int32)
    with fake_gpu_calls(arch) as fake:
        _kvcache_call(backend, causal=True, cp_world_size=4, cp_rank=1, cp_tot_seqused_k=tot)
        _kvcache_call(backend, causal=True, cp_world_size=8, cp_rank=5, cp_tot_seqused_k=tot, cp_kv_interleave=16)
        _kvcache_call(backend, window_size=(64, 0), cp_world_size=2, cp_rank=1, cp_tot_seqused_k=tot)
        _kvcache_call(backend, causal=True)
        _kvcache_call(backend, cp_world_size=4, cp_rank=3)  # no mask: plain attention over the shard
        _kvcache_call(backend)
    # one key per distinct kernel, in launch order: the second shard reuses the first's, the
    # unmasked shard the plain call's
    cp_causal, cp_window, causal, plain = fake.keys
    assert len({cp_causal, cp_window, causal, plain}) == 4
    flags = next(f for f in cp_causal if isinstance(f, tuple) and len(f) >= 3 and isinstance(f[0], bool))
    assert flags[-1] == "cp" and flags[0]


def test_cp_validation():
    from feature_pairs import fake_gpu_calls

    tot = torch.full((2,), 400, dtype=torch.int32)
    with fake_gpu_calls("sm_90a"):
        with pytest.raises(ValueError, match="cp_tot_seqused_k"):
            _kvcache_call("sm90", causal=True, cp_world_size=2, cp_rank=0)
        with pytest.raises(ValueError, match="cp_rank"):
            _kvcache_call("sm90", causal=True, cp_world_size=2, cp_rank=2, cp_tot_seqused_k=tot)
        with pytest.raises(ValueError, match="cp_world_size"):
            _kvcache_call("sm90", cp_world_size=0)
        with pytest.raises(ValueError, match="cp_tot_seqused_k"):
            _kvcache_call("sm90", causal=True, cp_world_size=2, cp_tot_seqused_k=tot[:1])
        with pytest.raises(NotImplementedError, match="learnable_sink"):
            _kvcache_call("sm90", causal=True, cp_world_size=2, cp_tot_seqused_k=tot, learnable_sink=torch.zeros(8))
        with pytest.raises(NotImplementedError, match="score_mod"):
            _kvcache_call("sm90", cp_world_size=2, cp_tot_seqused_k=tot, score_mod=lambda s, b, h, q, k, aux: s)
        with pytest.raises(NotImplementedError, match="append"):
            _kvcache_call("sm90", causal=True, cp_world_size=2, cp_tot_seqused_k=tot,
                          k=torch.randn(2, 1, 2, 128, dtype=torch.bfloat16),
                          v=torch.randn(2, 1, 2, 128, dtype=torch.bfloat16))


@pytest.mark.slow
@pytest.mark.parametrize("backend,kind,arch", [("sm80", "fwd", "sm_80"), ("sm80", "mla", "sm_90a"),
                                               ("sm90", "fwd", "sm_90a"), ("sm90", "mla", "sm_90a"),
                                               ("sm100", "fwd", "sm_100a")])
def test_cp_kernels_compile(backend, kind, arch, tmp_path):
    """The context-parallel kernels (the ContextParallel variant over causal and windowed
    forwards, causal MLA) compile for each backend's arch; SM100's for sm_100a."""
    from compile_harness import compile_entries

    out_dir, seconds = compile_entries(arch, [("cp", "cp_reference:compile_cp_calls", [backend, kind])], tmp_path)
    cubins = list((out_dir / "cp").glob(f"*.{arch}.cubin"))
    assert cubins and all(c.read_bytes()[:4] == b"\x7fELF" for c in cubins), (backend, kind, arch)
