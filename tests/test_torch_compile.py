"""torch.compile support: the public functions trace to one custom op (CPU, through the
fake kernels of test_validation), and on a GPU compiled and CUDA-graph calls equal eager.

CPU: ``torch.compile(fullgraph=True)`` (aot_eager: Dynamo, functionalization and the fake
implementation, no Inductor codegen) around each entry point gives the eager result,
and ``torch.library.opcheck`` validates the op's schema, fake implementation and
mutation declaration. GPU: fullgraph and ``mode="reduce-overhead"`` (CUDA graphs) on
prefill and decode, CUDA-graph replay with changed lengths and page tables, and no
device-to-host synchronisation in the default decode path.
"""

import pytest
import torch
from test_validation import fake_gpu, make_qkv  # noqa: F401  (fixture)

import flash_attn_cute as fa

F16 = torch.float16


def _model(q, k, v, kp, vp, table, lens):
    o, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True, num_splits=2)
    o2 = fa.flash_attn_with_kvcache(q, k, v, lens, window_size=(20, -1))
    o3 = fa.flash_attn_with_kvcache(q, kp, vp, 33, page_table=table)
    qv, kv, vv = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    cu_q = torch.arange(0, q.shape[0] + 1, dtype=torch.int32, device=q.device) * q.shape[1]
    cu_k = torch.arange(0, k.shape[0] + 1, dtype=torch.int32, device=q.device) * k.shape[1]
    o4 = fa.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, q.shape[1], k.shape[1])
    return o, lse, o2, o3, o4


def _inputs():
    # 64-key pages: a size every backend loads (SM90 through TMA)
    q, k, v = make_qkv(b=2, sq=3, sk=256, h=4, hk=2, d=64, dv=64)
    kp, vp = k.reshape(8, 64, 2, 64).contiguous(), v.reshape(8, 64, 2, 64).contiguous()
    table = torch.randperm(8).view(2, 4).to(torch.int32)
    return q, k, v, kp, vp, table, torch.tensor([256, 130], dtype=torch.int32)


def test_fullgraph_trace_equals_eager(fake_gpu):
    args = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(_model, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(*args), _model(*args)):
        torch.testing.assert_close(got, want)


def test_traced_out_buffer_is_written(fake_gpu):
    q, k, v = make_qkv()
    out = torch.full((2, 5, 4, 64), float("nan"), dtype=F16)

    def f(q, k, v, out):
        return fa.flash_attn_func(q, k, v, out=out)

    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, out)
    torch.testing.assert_close(out, fa.flash_attn_func(q, k, v))


def test_opcheck(fake_gpu):
    q, k, v = make_qkv(dtype=F16)
    out = torch.empty(2, 5, 4, 64, dtype=F16)
    for return_lse in (True, False):
        args = ("func", q, k, v, out, None, None, None, None, None, None, 5, 7, None, True, -1, 0, 0.0, 2, None,
                return_lse, None, False)
        torch.library.opcheck(torch.ops.flash_attn_cute.fwd.default, args)


# ------------------------------------------------------------------------------- GPU

def _cuda_inputs():
    return tuple(t.cuda() for t in _inputs())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("backend", ["sm80", "sm90"])
def test_gpu_compiled_equals_eager(mode, backend, monkeypatch):
    if not fa.fwd.backend_module(backend).runs_on(torch.cuda.get_device_capability()):
        pytest.skip(f"{backend} does not run on this GPU")
    monkeypatch.setenv("FLASH_ATTN_CUTE_BACKEND", backend)
    args = _cuda_inputs()
    torch._dynamo.reset()
    compiled = torch.compile(_model, fullgraph=True, mode=mode)
    want = _model(*args)
    for _ in range(3):  # reduce-overhead records a CUDA graph, then replays it
        got = compiled(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_cuda_graph_replay_with_new_lengths_and_pages(paged):
    from flash_attn_cute.testing import attention_kvcache_ref

    q, k, v, kp, vp, table, lens = _cuda_inputs()
    kc, vc, pt = (kp, vp, table) if paged else (k, v, None)
    out = torch.empty(2, 3, 4, 64, dtype=F16, device="cuda")
    fa.flash_attn_with_kvcache(q, kc, vc, lens, page_table=pt, out=out, num_splits=2)  # warm (compile)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fa.flash_attn_with_kvcache(q, kc, vc, lens, page_table=pt, out=out, num_splits=2)
    for new_lens in ([5, 256], [200, 1], [17, 130]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        if paged:
            pt.copy_(torch.randperm(8, device="cuda").view(2, 4).to(torch.int32))
        graph.replay()
        ref, _ = attention_kvcache_ref(q, kc, vc, lens, pt)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_default_decode_path_never_syncs():
    q, k, v, kp, vp, table, lens = _cuda_inputs()
    for _ in range(2):  # first: compile; second: the per-call cache
        torch.cuda.set_sync_debug_mode("error")
        try:
            fa.flash_attn_with_kvcache(q, k, v, lens)
            fa.flash_attn_with_kvcache(q, kp, vp, lens, page_table=table, num_splits=0)
            fa.flash_attn_func(q, k, v, num_splits=0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
