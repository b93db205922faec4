"""A continuous-batching serving loop over a paged KV cache: one attention call per layer per step.

A Llama-style decoder (RMSNorm, rotary, GQA attention, SwiGLU MLP; random seeded weights)
serves a stream of requests the way vLLM and SGLang do. A page allocator hands out KV pages
as sequences grow and takes them back when they finish. Each step packs the decode token of
every running sequence with chunks of new prompts (up to a token budget), and each layer
makes ONE ``flash_attn_with_kvcache`` call for the whole step: packed queries
(``cu_seqlens_q``), the new keys and values appended into their pages, rotary applied at
their absolute positions, causal over each sequence's cache. Decode-only steps replay a
CUDA graph captured once (static inputs, refilled each step).

``--check`` (default) runs the same model beside the loop with
``torch.nn.functional.scaled_dot_product_attention`` over dense per-sequence K/V (no pages,
no packing, rotary in torch), and requires the same greedy token at every sampled position
and logits within ``LOGIT_TOL``. Greedy argmax over random logits can tie, so the model is
built for the check: matmuls and logits in fp32 (only the attention runs in fp16), and the
attention branch scaled to 1% of the residual (``attn_gain``): the kernel's rounding then
moves logits by ~1e-5 of their spread, far below the top-1/top-2 gaps (the smallest gap
and the largest difference are reported), while a wrong page, position, length or mask
moves them by 1e-3 to 1e-2 and fails the logit bound at once, then the tokens.

``--attention reference`` swaps in ``reference_with_kvcache``: the same call's semantics in
plain torch, so the loop itself runs (and is tested) on a CPU.

    python examples/serve_paged.py [--steps 64] [--layers 4] [--page-size 16] [--no-check] [--no-graph]
"""

import argparse
import dataclasses
import itertools
import math
import random
import sys
import time

import torch
import torch.nn.functional as F

LOGIT_TOL = 1e-3  # logits are ~unit scale; fp16 attention moves them by ~1e-5, bf16 by ~1e-4


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 4
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    ffn: int = 2816
    vocab: int = 1024
    page_size: int = 16
    max_seq_len: int = 1024      # per sequence: the page table's width
    pool_tokens: int = 4096      # the KV pool, an eighth of what the slots could hold: admission waits
    slots: int = 32              # sequences running at once (the decode graph's batch)
    token_budget: int = 512      # tokens per step: decodes first, prompt chunks fill the rest
    prompt_len: tuple = (16, 512)
    wave_size: int = 16          # requests per arrival wave
    qk_gain: float = 2.0         # scores of std ~2: attention that picks, not a plain average
    attn_gain: float = 0.01      # the attention branch's share of the residual (see above)
    dtype: torch.dtype = torch.float16
    seed: int = 0


TINY = dict(hidden=256, heads=4, kv_heads=2, ffn=512, vocab=256, page_size=4, max_seq_len=160, pool_tokens=240,
            slots=6, token_budget=48, prompt_len=(3, 40), wave_size=5)


# ----------------------------------------------------------------------------- the model

def rms_norm(x, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # unit weights: nothing to learn here


def rotary_tables(cfg: Config, positions: int, device):
    """cos, sin ``(positions, head_dim / 2)`` in the attention dtype, as the kernel takes them."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    return angles.cos().to(device, cfg.dtype), angles.sin().to(device, cfg.dtype)


def apply_rotary(x, cos, sin, positions):
    """GPT-NeoX halves (``rotary_interleaved=False``): fp32 math, one rounding to x's dtype."""
    half = x.shape[-1] // 2
    c, s = cos[positions].float()[:, None], sin[positions].float()[:, None]
    x0, x1 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).to(x.dtype)


class Model:
    """fp32 weights drawn on the CPU from one seed (the same model on any device); q, k, v
    leave the projections in ``cfg.dtype``. ``forward(tokens, attend)`` takes the attention
    as ``attend(layer, q, k, v)`` of the packed, not yet rotated tokens."""

    def __init__(self, cfg: Config, device):
        g = torch.Generator().manual_seed(cfg.seed)

        def w(rows, cols, std):
            return (torch.randn(rows, cols, generator=g) * std).to(device)

        h, q_width, kv_width = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.cfg, self.embed = cfg, w(cfg.vocab, h, 1.0)
        self.layers = [dict(wqkv=torch.cat([w(h, q_width, cfg.qk_gain / h ** 0.5), w(h, 2 * kv_width, h ** -0.5)], 1),
                            wo=w(q_width, h, cfg.attn_gain / q_width ** 0.5), w_gate_up=w(h, 2 * cfg.ffn, h ** -0.5),
                            w_down=w(cfg.ffn, h, 0.5 / cfg.ffn ** 0.5)) for _ in range(cfg.layers)]
        self.lm_head = w(h, cfg.vocab, h ** -0.5)

    def forward(self, tokens, attend):
        cfg, n = self.cfg, tokens.shape[0]
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            q, k, v = (rms_norm(x) @ layer["wqkv"]).to(cfg.dtype).split(
                [cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim], dim=-1)
            o = attend(i, q.view(n, cfg.heads, -1), k.view(n, cfg.kv_heads, -1), v.view(n, cfg.kv_heads, -1))
            x = x + o.reshape(n, -1).float() @ layer["wo"]
            gate, up = (rms_norm(x) @ layer["w_gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["w_down"]
        return x

    def logits(self, x):
        return rms_norm(x) @ self.lm_head


# --------------------------------------------------------------------------- attention

def reference_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, *, page_table,
                           cu_seqlens_q, max_seqlen_q, causal, rotary_interleaved):
    """REFERENCE (plain torch; slow; host syncs, so no graph): ``flash_attn_with_kvcache`` with
    packed queries, append and rotary. New token i of sequence b is at position
    ``cache_seqlens[b] + i``: q and k are rotated there, k and v written into its page, then
    each sequence's queries attend (bottom-right causal) over its ``cache_seqlens[b] + new`` keys."""
    from flash_attn_cute.testing import attention_serving_ref

    assert causal and not rotary_interleaved, "the example uses causal attention and GPT-NeoX rotary"
    lens = cu_seqlens_q.diff().long()
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=q.device), lens)
    pos = cache_seqlens.long()[seq] + torch.arange(q.shape[0], device=q.device) - cu_seqlens_q.long()[seq]
    q, k = apply_rotary(q, rotary_cos, rotary_sin, pos), apply_rotary(k, rotary_cos, rotary_sin, pos)
    page, slot = page_table.long()[seq, pos // k_cache.shape[1]], pos % k_cache.shape[1]
    k_cache[page, slot], v_cache[page, slot] = k, v
    out, _ = attention_serving_ref(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, page_table=page_table,
                                   seqused_k=(cache_seqlens + lens).int(), causal=True)
    return out.to(q.dtype)


class DenseReference:
    """The check: the same model with SDPA over dense per-sequence K/V grown by torch.cat.
    SDPA runs in fp32 on the low-precision q, k, v (exact), rounded like the kernel's output."""

    def __init__(self, model: Model, cos, sin):
        self.model, self.cos, self.sin, self.kv = model, cos, sin, {}

    def logits(self, rows, tokens):
        spans, start = [], 0
        for seq, n in rows:
            spans.append((self.kv.setdefault(seq.rid, {}), seq.cached, start, n))
            start += n

        def attend(layer, q, k, v):
            out = torch.empty_like(q)
            for kv, cached, s, n in spans:
                pos = torch.arange(cached, cached + n, device=q.device)
                k_old, v_old = kv.get(layer, (k[:0], v[:0]))
                kv[layer] = (torch.cat([k_old, apply_rotary(k[s:s + n], self.cos, self.sin, pos)]),
                             torch.cat([v_old, v[s:s + n]]))
                group = q.shape[1] // k.shape[1]
                keys, values = (t.repeat_interleave(group, dim=1).transpose(0, 1).float() for t in kv[layer])
                mask = torch.ones(n, cached + n, dtype=torch.bool, device=q.device).tril(cached)
                qs = apply_rotary(q[s:s + n], self.cos, self.sin, pos).transpose(0, 1).float()
                out[s:s + n] = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask).transpose(0, 1)
            return out

        last = torch.tensor([s + n - 1 for _, _, s, n in spans], device=tokens.device)
        return self.model.logits(self.model.forward(tokens, attend)[last])


# ------------------------------------------------------------------ pages and requests

class PagePool:
    """A free list of KV pages. Admission reserves a request's worst case (prompt + new
    tokens), so a running sequence never waits for a page (no preemption needed); pages are
    handed out only as it grows. Page 0 is never handed out: padded graph rows write there."""

    def __init__(self, num_pages: int):
        self.capacity, self.free, self.reserved = num_pages - 1, list(range(num_pages - 1, 0, -1)), 0

    def reserve(self, n: int) -> bool:
        ok = self.reserved + n <= self.capacity
        self.reserved += n if ok else 0
        return ok

    def release(self, seq):
        self.free += seq.pages
        self.reserved -= seq.reserved
        seq.pages = []

    @property
    def in_use(self) -> int:
        return self.capacity - len(self.free)


@dataclasses.dataclass
class Sequence:
    rid: int
    arrival: int
    prompt_len: int
    max_new: int
    tokens: list                  # the prompt, then the generated tokens
    cached: int = 0               # tokens whose K/V are in the pages
    pages: list = dataclasses.field(default_factory=list)
    reserved: int = 0


def make_requests(cfg: Config, steps: int):
    """Three waves at steps 0, W, 2W (W = steps // 4), each spread over half a wave: prompts
    arrive while earlier requests decode, and the last quarter admits nothing (it drains)."""
    rng, wave = random.Random(cfg.seed), max(steps // 4, 1)
    requests = []
    for w in range(3 * cfg.wave_size):
        n = rng.randint(*cfg.prompt_len)
        requests.append(Sequence(w, w // cfg.wave_size * wave + rng.randint(0, wave // 2), n,
                                 rng.randint(2, max(2, wave)), [rng.randrange(cfg.vocab) for _ in range(n)]))
    return sorted(requests, key=lambda s: s.arrival)


class Scheduler:
    def __init__(self, cfg: Config, pool: PagePool, requests):
        self.cfg, self.pool, self.waiting, self.running, self.finished = cfg, pool, requests, [], []

    def schedule(self, step: int):
        """[(sequence, new tokens)]: every running decode (1 token), then prompt chunks while
        the token budget lasts; new arrivals are admitted while slots and pages allow."""
        cfg, pool = self.cfg, self.pool
        while self.waiting and self.waiting[0].arrival <= step and len(self.running) < cfg.slots:
            seq = self.waiting[0]
            seq.reserved = -(-(seq.prompt_len + seq.max_new) // cfg.page_size)
            if not pool.reserve(seq.reserved):
                break
            self.running.append(self.waiting.pop(0))
        rows, budget = [], cfg.token_budget
        for seq in sorted(self.running, key=lambda s: s.cached < s.prompt_len):
            n = min(len(seq.tokens) - seq.cached, budget)
            if n == 0:
                break
            while len(seq.pages) * cfg.page_size < seq.cached + n:
                seq.pages.append(pool.free.pop())
            rows.append((seq, n))
            budget -= n
        return rows

    def advance(self, rows, next_tokens: dict):
        """The caches grew by the rows' tokens; a row at its last token takes its greedy
        token (``next_tokens[row]``); a finished sequence gives its pages back. Returns those."""
        done = []
        for i, (seq, n) in enumerate(rows):
            seq.cached += n
            if i in next_tokens:
                seq.tokens.append(next_tokens[i])
                if len(seq.tokens) - seq.prompt_len == seq.max_new:
                    self.running.remove(seq)
                    self.pool.release(seq)
                    self.finished.append(seq)
                    done.append(seq)
        assert self.pool.in_use == sum(len(s.pages) for s in self.running), "page accounting"
        return done


# ------------------------------------------------------------------------------ engine

@dataclasses.dataclass
class StepInputs:
    tokens: torch.Tensor          # (total_q,) int64: every row's new tokens, packed
    cu_seqlens_q: torch.Tensor    # (rows + 1,) int32
    cache_seqlens: torch.Tensor   # (rows,) int32: tokens in the cache BEFORE this step
    page_table: torch.Tensor      # (rows, max_pages) int32, padded with page 0
    max_seqlen_q: int


def step_inputs(rows, max_pages: int, device) -> StepInputs:
    lens = [n for _, n in rows]
    tokens = [t for seq, n in rows for t in seq.tokens[seq.cached:seq.cached + n]]
    table = [seq.pages + [0] * (max_pages - len(seq.pages)) for seq, _ in rows]
    i32 = dict(dtype=torch.int32, device=device)
    return StepInputs(torch.tensor(tokens, device=device), torch.tensor([0, *itertools.accumulate(lens)], **i32),
                      torch.tensor([seq.cached for seq, _ in rows], **i32), torch.tensor(table, **i32), max(lens))


class Engine:
    """The paged caches and one model step: per layer ONE attention call with packed queries,
    append, rotary, the page table and causal masking. Returns fp32 logits of each row's last token."""

    def __init__(self, model: Model, attention, num_pages: int, max_pages: int, device):
        cfg = model.cfg
        self.model, self.attention = model, attention
        shape = (num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=cfg.dtype, device=device) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, dtype=cfg.dtype, device=device) for _ in range(cfg.layers)]
        self.cos, self.sin = rotary_tables(cfg, max_pages * cfg.page_size, device)  # covers every cache position

    def __call__(self, inp: StepInputs):
        def attend(layer, q, k, v):
            return self.attention(q, self.k[layer], self.v[layer], k, v, self.cos, self.sin, inp.cache_seqlens,
                                  page_table=inp.page_table, cu_seqlens_q=inp.cu_seqlens_q,
                                  max_seqlen_q=inp.max_seqlen_q, causal=True, rotary_interleaved=False)

        return self.model.logits(self.model.forward(inp.tokens, attend)[inp.cu_seqlens_q[1:].long() - 1])


def scratch_inputs(rows: int, tokens_per_row: int, max_pages: int, device, page: int = 0) -> StepInputs:
    """Rows of length 0 whose pages are all ``page`` (0: the scratch page): a step that writes there only."""
    return StepInputs(torch.zeros(rows * tokens_per_row, dtype=torch.int64, device=device),
                      torch.arange(0, rows * tokens_per_row + 1, tokens_per_row, dtype=torch.int32, device=device),
                      torch.zeros(rows, dtype=torch.int32, device=device),
                      torch.full((rows, max_pages), page, dtype=torch.int32, device=device), tokens_per_row)


class DecodeGraph:
    """A decode step of ``slots`` rows (one token each) captured once. The graph reads static
    tensors, so a step copies its tokens, lengths and page rows into them and replays; the
    rows past the running sequences keep length 0 and ``PAD_PAGE`` (their token is written
    there). On a CPU (the tests) the same padded step runs eagerly."""

    PAD_PAGE = 0  # the scratch page: PagePool never hands it out

    def __init__(self, engine: Engine, slots: int, max_pages: int, device):
        self.engine, self.inp, self.graph = engine, scratch_inputs(slots, 1, max_pages, device, self.PAD_PAGE), None
        if device.type == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile and warm the per-call caches: no host work left to capture
                engine(self.inp)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = engine(self.inp)

    def __call__(self, inp: StepInputs):
        n = inp.tokens.shape[0]
        for static, new, pad in ((self.inp.tokens, inp.tokens, 0), (self.inp.cache_seqlens, inp.cache_seqlens, 0),
                                 (self.inp.page_table, inp.page_table, self.PAD_PAGE)):
            static.fill_(pad)
            static[:n] = new
        if self.graph is None:
            return self.engine(self.inp)[:n]
        self.graph.replay()
        return self.logits[:n]


def progress_bar(total: int):
    """``update(text)`` for each step: tqdm when installed, else a carriage-return line (on a
    terminal only: in a log, 64 carriage returns are one unreadable line)."""
    try:
        from tqdm import tqdm
    except ImportError:
        count = itertools.count(1)

        def line(text):
            n = next(count)
            if sys.stderr.isatty():
                print(f"\rstep {n}/{total}  {text}", end="\n" if n == total else "", file=sys.stderr, flush=True)

        return line
    bar = tqdm(total=total, unit="step", file=sys.stderr)

    def update(text):
        bar.set_postfix_str(text, refresh=False)
        bar.update(1)
        if bar.n == total:
            bar.close()

    return update


class CheckFailed(AssertionError):
    pass


def check_step(step: int, rows, sampled, logits, ref_logits, stats):
    """Every row's logits within LOGIT_TOL of the SDPA model's, and each sampled row's greedy
    token equal to its token. A failure names the step, the request and the positions."""
    diff = (logits - ref_logits).abs().amax(-1).tolist()
    top2 = ref_logits.topk(2, dim=-1).values
    margins, ours, ref = (top2[:, 0] - top2[:, 1]).tolist(), logits.argmax(-1).tolist(), ref_logits.argmax(-1).tolist()
    stats["max_logit_diff"] = max(stats["max_logit_diff"], *diff)
    stats["min_margin"] = min([stats["min_margin"], *(margins[i] for i in sampled)])
    for i, (seq, n) in enumerate(rows):
        where = f"step {step}, request {seq.rid} (row {i}, positions {seq.cached}..{seq.cached + n - 1})"
        if diff[i] > LOGIT_TOL:
            raise CheckFailed(f"{where}: logits differ from the SDPA model's by {diff[i]:.3g} > {LOGIT_TOL}")
        if i in sampled and ours[i] != ref[i]:
            raise CheckFailed(f"{where}: greedy token {ours[i]} != the SDPA model's {ref[i]} (its top-1/top-2 "
                              f"margin {margins[i]:.3g}, logit difference {diff[i]:.3g})")


def run(cfg: Config, steps: int, device, attention="flash", graph=True, check=True, progress=True) -> dict:
    """Serves ``steps`` steps of ``make_requests``; returns the counters."""
    assert cfg.slots <= cfg.token_budget, "every running sequence decodes in every step"
    longest = cfg.prompt_len[1] + max(2, steps // 4)  # make_requests' longest request
    assert longest <= min(cfg.max_seq_len, cfg.pool_tokens - cfg.page_size), "a request that never fits"
    assert attention == "flash" or not (graph and device.type == "cuda"), "the reference cannot be captured"
    if attention == "flash":
        from flash_attn_cute import flash_attn_with_kvcache as attention_fn
    else:
        attention_fn = reference_with_kvcache
    model, max_pages = Model(cfg, device), -(-cfg.max_seq_len // cfg.page_size)
    pool = PagePool(cfg.pool_tokens // cfg.page_size + 1)
    engine = Engine(model, attention_fn, pool.capacity + 1, max_pages, device)
    engine(scratch_inputs(2, cfg.token_budget // 2, max_pages, device))  # compile a mixed step before timing
    decode_graph = DecodeGraph(engine, cfg.slots, max_pages, device) if graph else None
    sched = Scheduler(cfg, pool, make_requests(cfg, steps))
    reference = DenseReference(model, engine.cos, engine.sin) if check else None
    stats = dict(mixed_steps=0, decode_steps=0, generated=0, processed=0, peak_pages=0, serve_s=0.0,
                 max_logit_diff=0.0, min_margin=math.inf)
    update_bar = progress_bar(steps) if progress else None
    for step in range(steps):
        t0 = time.perf_counter()
        rows = sched.schedule(step)
        if rows:
            inp = step_inputs(rows, max_pages, device)
            decode_only = inp.max_seqlen_q == 1
            logits = decode_graph(inp) if decode_only and decode_graph else engine(inp)
            sampled = [i for i, (seq, n) in enumerate(rows) if seq.cached + n == len(seq.tokens)]
            tokens = logits[sampled].argmax(-1).tolist()  # the host schedules with them: one sync a step
            stats["serve_s"] += time.perf_counter() - t0
            if reference is not None:
                check_step(step, rows, sampled, logits, reference.logits(rows, inp.tokens), stats)
            stats["decode_steps" if decode_only else "mixed_steps"] += 1
            stats["generated"] += len(sampled)
            stats["processed"] += inp.tokens.shape[0]
            stats["peak_pages"] = max(stats["peak_pages"], pool.in_use)
            for seq in sched.advance(rows, dict(zip(sampled, tokens))):
                if reference is not None:
                    reference.kv.pop(seq.rid, None)
        if update_bar is not None:
            update_bar(f"running {len(sched.running)}, waiting {len(sched.waiting)}, pages {pool.in_use}/"
                       f"{pool.capacity}")
    stats.update(finished=len(sched.finished), unfinished=len(sched.running) + len(sched.waiting),
                 graph_replays=stats["decode_steps"] if decode_graph and decode_graph.graph else 0)
    for seq in sched.running:  # shutting down: what still runs gives its pages back
        pool.release(seq)
    stats.update(pages_in_use_at_end=pool.in_use, reserved_at_end=pool.reserved)
    return stats


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--page-size", type=int, default=None, help="KV page size (default 16; 4 with --tiny)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare every step with the dense SDPA model")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                   help="replay decode-only steps from a CUDA graph (flash attention on a GPU)")
    p.add_argument("--attention", choices=["flash", "reference"], default="flash",
                   help="flash_attn_with_kvcache, or its plain-torch reference (always on a CPU)")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                   help="the attention's dtype (bfloat16: ~8x more rounding, still within the checks)")
    p.add_argument("--tiny", action="store_true", help="a small model and workload (always on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    attention = args.attention if device.type == "cuda" else "reference"
    graph = args.graph and device.type == "cuda" and attention == "flash"
    sizes = dict(TINY if args.tiny or device.type == "cpu" else {}, layers=args.layers, seed=args.seed,
                 dtype=getattr(torch, args.dtype))
    cfg = Config(**{**sizes, **({"page_size": args.page_size} if args.page_size else {})})
    print(f"{device.type}: attention {attention}, graph {'on' if graph else 'off'}, check "
          f"{'on' if args.check else 'off'}; {cfg.layers} layers, hidden {cfg.hidden}, heads {cfg.heads}/"
          f"{cfg.kv_heads} x {cfg.head_dim}, {args.dtype}, page size {cfg.page_size}, {cfg.slots} slots, "
          f"{cfg.token_budget} tokens per step")
    s = run(cfg, args.steps, device, attention, graph, args.check)
    print(f"{args.steps} steps: {s['mixed_steps']} mixed, {s['decode_steps']} decode-only ({s['graph_replays']} graph "
          f"replays); {s['finished']} requests finished, {s['unfinished']} not; peak {s['peak_pages']} pages")
    print(f"{s['generated']} tokens generated, {s['processed']} processed in {s['serve_s']:.2f} s: "
          f"{s['generated'] / s['serve_s']:.0f} generated tokens/s, {s['processed'] / s['serve_s']:.0f} processed/s")
    if args.check:
        print(f"check passed: {s['generated']} greedy tokens equal the SDPA model's; smallest top-1/top-2 margin "
              f"{s['min_margin']:.3g}, largest logit difference {s['max_logit_diff']:.3g} (bound {LOGIT_TOL})")
    return s


if __name__ == "__main__":
    main()
