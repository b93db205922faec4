"""CPU side of the feature-pair sweep (``feature_pairs.py``): every pair of forward
features through validation, planning and compile keys on every backend (a fake GPU: no
kernel runs), and a covering subset of the pairs' kernels compiled for each backend's
arch. The GPU side, against an fp64 reference, is ``test_feature_pairs_gpu.py``."""

import pytest
from compile_harness import compile_entries
from feature_pairs import PAIR_ARCHS, PAIRS, REFUSED, pair_keys

from flash_attn_cute import seam

BACKENDS = sorted(seam.BACKENDS)


def _keys_or_refusal(backend, pair):
    try:
        return pair_keys(backend, pair, PAIR_ARCHS[backend]), None
    except (ValueError, TypeError, NotImplementedError) as err:
        return None, err


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_pair_plans_or_is_refused_by_name(backend):
    """SM80 and SM90 run every pair the API accepts; SM100 may refuse one with its reason
    (automatic selection then runs SM80). A refused pair names what it refuses."""
    for pair in PAIRS:
        keys, err = _keys_or_refusal(backend, pair)
        refusal = REFUSED.get(frozenset(pair))
        if refusal is not None:
            assert isinstance(err, refusal[0]) and refusal[1] in str(err), (pair, err)
        elif backend == "sm100" and isinstance(err, NotImplementedError):
            assert "cannot run this call" in str(err), (pair, err)
        else:
            assert err is None, (backend, pair, err)
            assert keys, (backend, pair)


def _covering_pairs(backend):
    """Pairs whose kernels together show every value of every compile-key field the
    whole sweep uses on ``backend`` (greedy set cover; the key's name and arch aside)."""
    features = {}
    for pair in PAIRS:
        keys, err = _keys_or_refusal(backend, pair)
        if err is None:
            features[pair] = {(i, repr(v)) for key in keys for i, v in enumerate(key) if i >= 2}
    uncovered, chosen = set().union(*features.values()), []
    while uncovered:
        best = max(sorted(features), key=lambda p: len(features[p] & uncovered))
        chosen.append(best)
        uncovered -= features[best]
    return chosen


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_pair_kernels_compile(backend, tmp_path):
    arch = PAIR_ARCHS[backend]
    pairs = _covering_pairs(backend)
    entries = [(f"p{i}", "feature_pairs:compile_pair", [backend, *pair]) for i, pair in enumerate(pairs)]
    out_dir, seconds = compile_entries(arch, entries, tmp_path)
    print(f"\n{backend} {arch}: {len(pairs)} pairs, {sum(seconds.values()):.0f} s")
    for i, pair in enumerate(pairs):
        cubins = list((out_dir / f"p{i}").glob(f"*.{arch}.cubin"))
        assert cubins and all(c.read_bytes()[:4] == b"\x7fELF" for c in cubins), pair
