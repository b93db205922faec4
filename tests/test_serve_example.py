"""Tests of the serving example (``examples/serve_paged.py``) and of the serving-step benchmark's
step construction (``benchmarks/bench_serving_step.py``).

On a CPU the example's loop runs with ``reference_with_kvcache`` (the call's semantics in
plain torch): greedy tokens and logits must match the dense SDPA model at every step, decode
steps go through the padded fixed-batch path the CUDA graph replays, and every page is back
in the pool at the end; the check itself must catch a wrong key count and padded rows that
write into a live page. On a GPU (``-m gpu``) the loop runs on the kernels, graphs on.
"""

import importlib.util
import os
import sys

import pytest
import torch

from flash_attn_cute.testing import attention_ref, attention_serving_ref, gather_paged_kv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(relpath, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def serve():
    return _load("examples/serve_paged.py", "serve_paged")


@pytest.fixture(scope="module")
def bench_step():
    folder = os.path.join(ROOT, "benchmarks")
    sys.path.insert(0, folder)  # the benchmarks import their common.py as a sibling
    try:
        return _load("benchmarks/bench_serving_step.py", "bench_serving_step")
    finally:
        sys.path.remove(folder)


CPU = torch.device("cpu")


def _tiny(serve, **kw):
    return serve.Config(**{**serve.TINY, "layers": 2, **kw})


def test_loop_on_cpu_matches_sdpa_and_frees_every_page(serve):
    s = serve.run(_tiny(serve), 16, CPU, attention="reference", graph=True, check=True, progress=False)
    assert s["mixed_steps"] > 0 and s["decode_steps"] > 0  # prefill chunks beside decodes, and padded decode steps
    assert s["generated"] > 0 and s["max_logit_diff"] <= serve.LOGIT_TOL
    assert s["min_margin"] > 2 * s["max_logit_diff"]  # no greedy choice decided by rounding
    assert s["finished"] == 15 and s["unfinished"] == 0  # the last quarter drained every request
    assert s["pages_in_use_at_end"] == 0 and s["reserved_at_end"] == 0


def test_the_check_catches_a_wrong_key_count(serve, monkeypatch):
    # The reference call appends correctly but attends as if each cache held one token fewer.
    import flash_attn_cute.testing as testing

    real = testing.attention_serving_ref
    monkeypatch.setattr(testing, "attention_serving_ref",
                        lambda *a, seqused_k, **kw: real(*a, seqused_k=(seqused_k - 1).clamp(min=1), **kw))
    with pytest.raises(serve.CheckFailed, match=r"step \d+, request \d+ \(row \d+, positions \d+\.\.\d+\): logits"):
        serve.run(_tiny(serve), 8, CPU, attention="reference", graph=False, check=True, progress=False)


def test_the_check_catches_padded_rows_writing_into_a_live_page(serve, monkeypatch):
    # The decode step pads its fixed batch with rows on the scratch page, which the pool never
    # hands out; padding on page 1 (a live page) instead overwrites a running sequence's keys.
    monkeypatch.setattr(serve.DecodeGraph, "PAD_PAGE", 1)
    with pytest.raises(serve.CheckFailed):
        serve.run(_tiny(serve), 16, CPU, attention="reference", graph=True, check=True, progress=False)


def test_page_pool_reserves_worst_case_and_hands_out_pages_lazily(serve):
    pool = serve.PagePool(9)  # 8 pages to hand out; page 0 is the scratch page
    assert pool.capacity == 8 and 0 not in pool.free
    assert pool.reserve(5) and not pool.reserve(4) and pool.reserve(3)
    seq = serve.Sequence(0, 0, 3, 2, [1, 2, 3], pages=[pool.free.pop(), pool.free.pop()], reserved=5)
    assert pool.in_use == 2
    pool.release(seq)
    assert pool.in_use == 0 and pool.reserved == 3 and seq.pages == []


def test_cli_runs_on_cpu(serve, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, on a GPU machine too
    s = serve.main(["--steps", "6", "--layers", "1", "--no-check"])
    out = capsys.readouterr().out
    assert s["generated"] > 0 and "cpu: attention reference, graph off" in out and "generated tokens/s" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_loop_on_gpu_kernels_matches_sdpa(serve):
    # The default model (4 layers, hidden 1024, 16/4 heads x 64, fp16) with smaller arrival
    # waves, so that 24 steps have decode-only steps (graph replays) after mixed ones.
    cfg = serve.Config(wave_size=8)
    s = serve.run(cfg, 24, torch.device("cuda"), attention="flash", graph=True, check=True, progress=False)
    assert s["mixed_steps"] > 0 and s["graph_replays"] > 0
    assert s["generated"] > 0 and s["max_logit_diff"] <= serve.LOGIT_TOL
    assert s["pages_in_use_at_end"] == 0 and s["reserved_at_end"] == 0


# ------------------------------------------------------------------ the benchmark's step

def _small_step(bench_step, page_size=4, seed=3):
    return bench_step.build_step(page_size, n_decode=6, decode_lens=(3, 40), n_prefill=2, chunk=7, context=(0, 20),
                                 H=4, hkv=2, D=64, device="cpu", seed=seed)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_bench_step_pages_hold_each_sequence(bench_step, page_size):
    step = _small_step(bench_step, page_size)
    lens, table = step.seqused_k.tolist(), step.page_table
    cu = step.cu_seqlens_q.tolist()
    assert [cu[b + 1] - cu[b] for b in range(len(lens))] == [1] * 6 + [7] * 2
    assert all(7 <= n <= 27 for n in lens[6:]) and all(3 <= n <= 40 for n in lens[:6])
    used = [table[b, :-(-n // page_size)].tolist() for b, n in enumerate(lens)]
    flat = [p for pages in used for p in pages]
    assert len(set(flat)) == len(flat) and flat != sorted(flat)  # no page shared; a random order
    for b, n in enumerate(lens):
        k, v = bench_step.sequence_kv(step, b)
        assert torch.equal(gather_paged_kv(step.k_cache, table[b:b + 1])[0, :n], k)
        assert torch.equal(gather_paged_kv(step.v_cache, table[b:b + 1])[0, :n], v)


def test_bench_step_reference_equals_dense_attention(bench_step):
    # The paged, packed reference over the step equals attention over each sequence's dense
    # K/V (its queries the last positions): page tables, lengths and cu_seqlens agree.
    step = _small_step(bench_step)
    out, _ = attention_serving_ref(step.q, step.k_cache, step.v_cache, cu_seqlens_q=step.cu_seqlens_q,
                                   seqused_k=step.seqused_k, page_table=step.page_table, causal=True)
    cu = step.cu_seqlens_q.tolist()
    for b in range(len(cu) - 1):
        k, v = bench_step.sequence_kv(step, b)
        dense, _ = attention_ref(step.q[None, cu[b]:cu[b + 1]], k[None], v[None], causal=True)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], dense[0], rtol=0, atol=0)
    assert bench_step.check_subset(step, out.to(step.q.dtype))
    assert len(bench_step.check_rows(step)) >= 4


def test_bench_check_subset_rejects_a_wrong_output(bench_step):
    step = _small_step(bench_step)
    out, _ = attention_serving_ref(step.q, step.k_cache, step.v_cache, cu_seqlens_q=step.cu_seqlens_q,
                                   seqused_k=step.seqused_k, page_table=step.page_table.roll(1, dims=1), causal=True)
    assert not bench_step.check_subset(step, out.to(step.q.dtype))
    sink = torch.randn(4).to(torch.bfloat16)
    with_sink, _ = attention_serving_ref(step.q, step.k_cache, step.v_cache, cu_seqlens_q=step.cu_seqlens_q,
                                         seqused_k=step.seqused_k, page_table=step.page_table, causal=True,
                                         learnable_sink=sink)
    assert bench_step.check_subset(step, with_sink.to(step.q.dtype), learnable_sink=sink)
    assert not bench_step.check_subset(step, with_sink.to(step.q.dtype))


def test_bench_help_without_a_gpu(bench_step, capsys):
    with pytest.raises(SystemExit) as e:
        bench_step.parse_args(["--help"])
    assert e.value.code == 0 and "--sinks" in capsys.readouterr().out


def test_bench_calls_pass_the_api_as_written(bench_step, fake_device):
    # The benchmark's three call shapes reach the launcher on a fake GPU: the single varlen
    # call over the whole step, and the two-call split writing into views of one output.
    from types import SimpleNamespace

    from flash_attn_cute import sm80

    launches = []

    def launcher(problem, plan, device=None):
        return lambda tensors: launches.append((problem, tensors))

    fake_device(lambda name, kind="fwd": SimpleNamespace(AUTO=True, runs_on=sm80.runs_on, check=lambda p: None,
                                                          plan=sm80.plan, launcher=launcher))
    step = _small_step(bench_step)
    sink = torch.randn(4).to(torch.bfloat16)
    bench_step.single_call(step, None, sink)()
    (single, tensors), = launches
    assert single.varlen_q and single.page_size == 4 and single.batch == 8 and single.causal and single.has_sink
    assert tensors[0] is step.q and tensors[8] is step.page_table
    out = bench_step.two_calls(step, None, sink)()
    (prefill, t_pre), (decode, t_dec) = launches[1:]
    assert (prefill.batch, prefill.max_seqlen_q, decode.batch, decode.max_seqlen_q) == (2, 7, 6, 1)
    assert t_pre[8].data_ptr() == step.page_table[6].data_ptr() and t_dec[7].data_ptr() == step.seqused_k.data_ptr()
    # short caches: no split-KV, so each launch writes its rows of the one packed output
    assert t_pre[3].data_ptr() == out[6].data_ptr() and t_dec[3].data_ptr() == out.data_ptr()
