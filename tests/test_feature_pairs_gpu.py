"""Every pair of forward features (``feature_pairs.py``) on the GPU, per backend, against
an fp64 reference: out and LSE within 2x PyTorch's own bf16 error (``check_close``; an FP8
cache on SM90 where its kernel quantized the queries (the launch's plan): out within 3x
PyTorch's FP8 algorithm on the same quantized queries, ``PairCall.mult``), the
output written into a NaN-poisoned ``out=``. A pair the API refuses must be refused with
its message, before any launch. The CPU side (validation, plans, compiles) is
``test_feature_pairs.py``."""

import pytest
import torch
from feature_pairs import PAIRS, make_pair_call

from flash_attn_cute.testing import any_quantized_q, backends_on_this_gpu, check_close, check_lse, recorded_plans

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
@pytest.mark.parametrize("backend", backends_on_this_gpu())
def test_feature_pair(backend, pair):
    call = make_pair_call(pair, backend, "cuda")
    if call.refusal is not None:
        exc, message = call.refusal
        with pytest.raises(exc, match=message):
            call.fn(*call.args, **call.kwargs)
        return
    q, v = call.args[0], call.args[2]
    out = torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), device=q.device, dtype=torch.bfloat16)
    with recorded_plans() as plans:
        out, lse = call.fn(*call.args, **call.kwargs, out=out)
    quantized_q = any_quantized_q(plans)
    ref_out, ref_lse = call.reference(torch.float64, plans)
    pt_out, pt_lse = call.reference(torch.bfloat16, plans)
    check_close(out, ref_out, pt_out, mult=call.mult(quantized_q))
    check_lse(lse, ref_lse, pt_lse)
