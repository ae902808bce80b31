#!/usr/bin/env python3
"""DeepSeek-V4's real sglang model path on CPU, into the mma kernel, checked three ways.

A tiny DSV4 (tools/make_tiny_model.py dsv4) goes through sglang's own ModelRunner, as
`sglang.benchmark.one_batch` drives it: the real loader, KV pool, allocator and the DSV4 backend's
metadata, with `get_platform().is_sm120` set in-process so that attention goes through
`flash_mla_with_kvcache_sm120`. It runs a prefill and --steps decode steps twice, in two fresh
processes: with SGLANG_SM120_FLASHMLA_BACKEND=mma (our kernel, under the Triton interpreter) and
with upstream's `torch` backend, fed the mma run's greedy tokens. transformers' own DSV4 runs the
same weights on the same tokens in float32, with its KV quantized to FP8 as sglang's pool stores
it (and once without, for scale).

It checks:
1. every kernel call (spied on, and counted: one per layer per forward): `k_cache` is a view of
   the pool's own buffer for that layer, the index lists, lengths and sink are the ones the
   backend built, each row's SWA length is min(position + 1, window), and the output matches
   upstream's torch reference (`_sm120_sparse_decode_fwd`) on the same arguments (for the
   torch backend, whose kernel that is: a dense reference, the listed keys read from the
   pool's buffers through upstream's V4 dequantizer, one softmax with the sink); on c4/c128
   layers also the compressed index lists and lengths (every entry so far, the c4 indexer's
   top-k of them, none before the first window closes);
2. the whole model, per step: max abs diff, cosine and top-1 of the logits, mma against torch
   (greedy tokens must be identical) and against transformers;
3. on c4/c128 layers, every compressed entry of the fed tokens (main KV and the indexer's keys),
   read back from sglang's pools, against transformers' compressors, entry by entry.

Prints a per-step table and a verdict; exits 0 when every check holds, 1 when one does not, 2 on
bad input (a model directory missing a file, a config that is not DSV4, a compress ratio sglang
does not support).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("mma", "torch")
SUPPORTED_RATIOS = {0, 4, 128}
# The switches that keep sglang's DSV4 path on ops with a CPU implementation (torch or the
# Triton interpreter) instead of TileLang/DeepGEMM/JIT CUDA ones.
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "TRITON_INTERPRET": "1",
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0",
    "SGLANG_OPT_USE_TILELANG_MHC_POST": "0",
    "SGLANG_OPT_FUSE_MHC_POST_PRE": "0",
    "SGLANG_OPT_DEEPGEMM_HC_PRENORM": "0",
    "SGLANG_OPT_USE_FUSED_HASH_TOPK": "0",
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
}

# Thresholds (see bench/README.md, "The real model path", for how they were chosen).
# mma vs torch: the same FP8 cache and the same arguments, so only the kernels' own bf16
# rounding (P and the output, in different orders; up to 1% of a call's largest output) separates
# them, carried through the layers after it. Max abs is taken relative to the logits' std.
MMA_TORCH_MIN_COS = 0.9995
MMA_TORCH_MAX_REL = 0.1
# Compressed entries (normed, rotated, FP8 in sglang's pools) against transformers' compressors
# in float32: e4m3 keeps 3 mantissa bits, and the values come from bf16 projections.
ENTRY_MIN_COS = 0.995
# sglang vs transformers with FP8-quantized KV: bf16 weights and activations in sglang against
# float32 in transformers, over every layer.
HF_MIN_COS = 0.999
# Top-k routing. Every run takes one expert choice per token (sglang's first run's; see main),
# and each router's own scores are checked against it. Router scores here are the ranking
# scores: sqrtsoftplus of the router logits plus the correction bias, O(1) values that sglang
# computes from bf16 activations. Both bounds are set from measured runs on five top-k models
# and seeds (bench/README.md, "Top-k routing"), about 1.5 times the largest value seen:
# - a token whose router would have picked other experts is a near-tie when its own pick ranks
#   at most this much above the experts it takes (measured at most 0.024 against transformers
#   with FP8 KV, 0.012 between two sglang runs); a wider flip fails: the router's inputs differ.
ROUTER_TIE_MAX = 0.035
# - every token's scores, sglang's first run against transformers (FP8 KV), per top-k layer:
#   at most this far apart (measured at most 0.032); a router whose inputs or weights differ on
#   any token fails here even where no choice flips.
ROUTER_SCORE_MAX_DIFF = 0.05


def route_flip(ranked, mine: set, theirs: set, layer: int, token: int) -> dict:
    """One token whose router picked `mine` where the reference took `theirs`: its margin is
    how much higher this router ranks the experts it picked than those it was made to take.
    sglang's routers rank in bf16 and this re-ranks their logits in float32, so a tie sglang
    broke the other way reads as a margin just below 0 (down to bf16's spacing, 2**-7 here)."""
    margin = (ranked[sorted(mine - theirs)].min() - ranked[sorted(theirs - mine)].max()).item()
    return {"layer": layer, "token": token, "own": sorted(mine), "reference": sorted(theirs),
            "margin": margin}  # fmt: skip


def router_ranking(config, logits):
    """(scores, ranked) of one sglang top-k router, as its TopKConfig scores them: the score
    function of the logits (the weights' source) and those plus the correction bias (the
    choice's)."""
    import torch

    logits = logits.float()
    func = config.scoring_func
    if func == "sqrtsoftplus":
        scores = torch.nn.functional.softplus(logits).sqrt()
    elif func == "sigmoid":
        scores = logits.sigmoid()
    elif func == "softmax":
        scores = logits.softmax(-1)
    else:
        raise BadInput(f"router scoring function {func!r}: the routing replay does not know it")
    bias = config.correction_bias
    return scores, scores if bias is None else scores + bias.float().view(1, -1)


def replayed(out, want, ranked, config, layer: int, start: int, flips: list):
    """sglang's top-k output `out` with each token's experts replaced by the reference's
    (`want`, [tokens, k]) where they differ, weighted by this router's own scores as it weights
    any choice (renormalized to the same sum, or scaled by the same factor); each replaced token
    is appended to `flips`."""
    import torch

    scores, ranks = ranked
    experts = scores.shape[1]
    ids, weights = out.topk_ids.clone(), out.topk_weights.clone()
    for t in range(ids.shape[0]):
        mine = {e for e in ids[t].tolist() if e < experts}  # shared-expert slots stay
        theirs = {e for e in want[t].tolist() if e < experts}
        if mine == theirs:
            continue
        flips.append(route_flip(ranks[t], mine, theirs, layer, start + t))
        cols = torch.tensor([c for c, e in enumerate(ids[t].tolist()) if e < experts])
        new = torch.tensor(sorted(theirs))
        old_w, old_s = weights[t, cols].float(), scores[t, ids[t, cols].long()]
        new_s = scores[t, new]
        if config.renormalize:
            new_w = new_s / new_s.sum() * old_w.sum()
        else:
            new_w = new_s * (old_w.sum() / old_s.sum())
        ids[t, cols] = new.to(ids.dtype)
        weights[t, cols] = new_w.to(weights.dtype)
    return out._replace(topk_ids=ids, topk_weights=weights)


class BadInput(Exception):
    pass


def _fail(msg: str) -> int:
    print(f"dsv4_check: {msg}", file=sys.stderr)
    return 2


def check_model_dir(model: Path) -> dict:
    """The model directory's config, or BadInput naming what is wrong."""
    if not model.is_dir():
        raise BadInput(f"{model}: no such model directory")
    for name in ("config.json", "tokenizer.json"):
        if not (model / name).is_file():
            raise BadInput(f"{model}: missing {name}")
    if not list(model.glob("*.safetensors")):
        raise BadInput(f"{model}: missing the weights (*.safetensors)")
    try:
        cfg = json.loads((model / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise BadInput(f"{model}/config.json: not JSON ({err})") from None
    if cfg.get("model_type") != "deepseek_v4":
        raise BadInput(
            f"{model}: model_type is {cfg.get('model_type')!r}, not 'deepseek_v4' "
            "(make one with tools/make_tiny_model.py dsv4)"
        )
    ratios = cfg.get("compress_ratios")
    if not isinstance(ratios, list) or not ratios:
        raise BadInput(f"{model}/config.json: no compress_ratios list")
    bad = sorted(set(ratios) - SUPPORTED_RATIOS)
    if bad:
        raise BadInput(
            f"{model}/config.json: compress ratio(s) {bad} are not ones sglang's DSV4 supports "
            f"({sorted(SUPPORTED_RATIOS)})"
        )
    return cfg


def standard_model(standard: str) -> Path:
    """The standard tiny DSV4, made (or reused) by tools/make_tiny_model.py."""
    cmd = [sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "dsv4"]
    proc = subprocess.run(
        [*cmd, "--standard", standard], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise BadInput(f"tools/make_tiny_model.py dsv4 failed:\n{proc.stderr.strip()}")
    sys.path.insert(0, str(ROOT))
    from tools import make_tiny_model, tiny_dsv4

    return make_tiny_model.cache_dir() / tiny_dsv4.STANDARD[standard].name


def prompt_ids(cfg: dict, length: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    special = {cfg.get("bos_token_id"), cfg.get("eos_token_id")}
    pool = [t for t in range(cfg["vocab_size"]) if t not in special]
    return [cfg["bos_token_id"], *(rng.choice(pool) for _ in range(length - 1))]


# --- the worker: one backend, in its own process -----------------------------------------


class KernelSpy:
    """Wraps flash_mla_with_kvcache_sm120 and the backend's _forward_attention."""

    def __init__(self, window: int, index_topk: int, native: int = 1 << 30):
        self.window, self.index_topk, self.native = window, index_topk, native
        self.calls: list[dict] = []
        self._ctx: list[tuple] = []

    def install(self) -> None:
        import inspect

        import sglang.kernels.ops.attention.flash_mla_sm120 as fm
        from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend

        kernel = fm.flash_mla_with_kvcache_sm120
        forward_attention = DeepseekV4AttnBackend._forward_attention
        signature = inspect.signature(forward_attention)
        spy = self

        def _forward_attention(backend, *args, **kwargs):
            bound = signature.bind(backend, *args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            spy._ctx.append((backend, a["layer"].layer_id, a["compress_ratio"], a))
            try:
                return forward_attention(backend, *args, **kwargs)
            finally:
                spy._ctx.pop()

        def flash_mla_with_kvcache_sm120(**kw):
            out = kernel(**kw)
            spy.record(fm, kw, out)
            return out

        DeepseekV4AttnBackend._forward_attention = _forward_attention
        fm.flash_mla_with_kvcache_sm120 = flash_mla_with_kvcache_sm120
        self._count_interpreted_kernels()
        self._record_compressed_entries()

    def record_routing(self, model, replay: dict | None = None) -> None:
        """Note each MoE layer's expert choice per token (its top-k module's output) and its
        router scores; with `replay` (a reference run's choice, {layer: [tokens, k]}), take
        the reference's experts wherever this run's router picked others, each such token
        noted in `flips` with this run's margin for its own pick (`route_flip`)."""
        self._routes: dict[int, list] = {}
        self._scores: dict[int, list] = {}
        self.flips: list[dict] = []
        cursor: dict[int, int] = {}
        for i, layer in enumerate(model.model.layers):
            topk = getattr(getattr(layer, "mlp", None), "topk", None)
            if topk is None:
                continue

            def hook(module, args, out, i=i):
                ids = getattr(out, "topk_ids", None)
                if ids is None:
                    return None
                config = getattr(module, "topk_config", None)  # None: a hash layer
                scored = None if config is None else router_ranking(config, out.router_logits)
                start = cursor.get(i, 0)
                cursor[i] = start + ids.shape[0]
                if replay is not None and i in replay and scored is not None:
                    want = replay[i][start : cursor[i]]
                    out = replayed(out, want, scored, config, i, start, self.flips)
                self._routes.setdefault(i, []).append(out.topk_ids.detach().long().cpu().clone())
                if scored is not None:
                    self._scores.setdefault(i, []).append(scored[1].detach().cpu())
                return out

            topk.register_forward_hook(hook)

    def routes(self) -> dict:
        """{layer: [tokens, k] expert ids, in the order the tokens were fed}."""
        import torch

        return {i: torch.cat(ids) for i, ids in getattr(self, "_routes", {}).items()}

    def router_scores(self) -> dict:
        """{layer: [tokens, experts]}: each top-k router's ranking scores (its score function
        of the logits plus the correction bias), in the order the tokens were fed."""
        import torch

        return {i: torch.cat(s) for i, s in getattr(self, "_scores", {}).items()}

    def _record_compressed_entries(self) -> None:
        """Note where each compressing layer stores each compressed entry (main KV and the
        indexer's keys), so that `entries` can read them back from the pools."""
        import sglang.srt.layers.attention.dsv4.compressor_v2 as cv2

        self.stores: list[dict] = []
        forward_unified, store = (
            cv2.CompressorBackendMixin.forward_unified,
            cv2.compress_norm_rope_store,
        )
        spy, current = self, []

        def spied_forward(backend, x, forward_batch, layer_id, compressor):
            current.append((layer_id, compressor.is_in_indexer))
            try:
                return forward_unified(backend, x, forward_batch, layer_id, compressor)
            finally:
                current.pop()

        def spied_store(kv, plan, **kw):
            from sglang.kernels.ops.attention.dsv4 import cpu_compress

            store(kv, plan, **kw)
            _, positions, loc = cpu_compress._entries(plan, plan.compress_ratio, kw["out_loc"])
            layer, is_index = current[-1]
            spy.stores.append({
                "layer": layer, "index": is_index, "ratio": plan.compress_ratio,
                "entry": (positions // plan.compress_ratio).tolist(), "loc": loc,
                "cache": kw["kvcache"], "page_size": kw["page_size"],
            })  # fmt: skip

        cv2.CompressorBackendMixin.forward_unified = spied_forward
        cv2.CompressorBackendMixin.forward_indexer_compressor = spied_forward
        cv2.CompressorBackendMixin.forward_core_compressor = spied_forward
        cv2.compress_norm_rope_store = spied_store

    def entries(self) -> dict:
        """{"LAYER:kv"|"LAYER:index": {"ratio", "entry": [n...], "value": [N, dim] fp32}}, read
        back from the pools as they are now: the main KV through upstream's V4 dequantizer, the
        indexer's keys as FP8 times their scale, Hadamard-rotated back."""
        import torch
        from sglang.kernels.ops.attention.dsv4 import cpu_compress
        from sglang.test.kernels.deepseek_v4.k_cache_reference import (
            dequantize_k_cache_paged_ref,
        )

        out: dict = {}
        for st in self.stores:
            if len(st["loc"]) == 0:  # a decode step that closed no window
                continue
            key = f"{st['layer']}:{'index' if st['index'] else 'kv'}"
            if st["index"]:
                keys = cpu_compress.load_index_k(st["loc"], st["cache"], st["page_size"])
                value = cpu_compress.hadamard(keys)
            else:
                value = dequantize_k_cache_paged_ref(st["cache"], st["loc"], st["page_size"])
                value = value.reshape(len(st["loc"]), -1).float()
            got = out.setdefault(key, {"ratio": st["ratio"], "entry": [], "value": []})
            got["entry"] += st["entry"]
            got["value"].append(value)
        for got in out.values():
            got["value"] = torch.cat(got["value"])
        return out

    def _count_interpreted_kernels(self) -> None:
        """Name every Triton kernel that runs (they all run in the interpreter here)."""
        from triton.runtime.interpreter import InterpretedFunction

        self.triton: dict[str, int] = {}
        run, spy = InterpretedFunction.run, self

        def counted(fn, *args, **kwargs):
            name = f"{fn.fn.__module__}.{fn.fn.__name__}"
            spy.triton[name] = spy.triton.get(name, 0) + 1
            return run(fn, *args, **kwargs)

        InterpretedFunction.run = counted

    @staticmethod
    def dense_attention(kw: dict, pool, layer_id: int, heads: int):
        """The sparse decode written out, for the torch backend (whose kernel is upstream's
        torch reference): every listed key read from the pool's own buffers through upstream's
        V4 dequantizer (not the kernel's gather), q.k times the scale, the sink as one more
        logit with a zero value, one softmax. (out [rows, s_q, heads, dv], lse [rows, heads,
        s_q] without the sink), fp32, for the first `heads` heads."""
        import torch
        from sglang.test.kernels.deepseek_v4.k_cache_reference import (
            dequantize_k_cache_paged_ref,
        )

        q = kw["q"].float()[..., :heads, :]
        rows, s_q = q.shape[:2]
        keys, listed = [], []
        sources = [
            (pool.get_swa_key_buffer_radix(layer_id), kw["k_cache"], "indices", "topk_length")
        ]
        if kw.get("extra_k_cache") is not None:
            extra = pool.get_extra_key_buffer(layer_id)
            sources.append(
                (extra, kw["extra_k_cache"], "extra_indices_in_kvcache", "extra_topk_length")
            )
        for buffer, view, indices, lengths in sources:
            idx = kw[indices].reshape(rows, s_q, -1).long()
            n = idx.shape[-1]
            ok = idx >= 0
            if kw.get(lengths) is not None:
                ok &= torch.arange(n).view(1, 1, n) < kw[lengths].reshape(rows, 1, 1)
            at, inverse = torch.unique(idx.clamp(min=0), return_inverse=True)
            k = dequantize_k_cache_paged_ref(buffer, at, view.shape[1]).reshape(len(at), -1)
            keys.append(k.float()[inverse])
            listed.append(ok)
        k, ok = torch.cat(keys, 2), torch.cat(listed, 2)
        scale = kw.get("softmax_scale") or kw["q"].shape[-1] ** -0.5
        logits = torch.einsum("bshd,bsnd->bshn", q[..., : k.shape[-1]], k) * scale
        logits = logits.masked_fill(~ok[:, :, None, :], float("-inf"))
        sink = torch.full((heads,), float("-inf"))
        if kw.get("attn_sink") is not None:
            sink = kw["attn_sink"].float().reshape(-1)[:heads]
        sink = sink.view(1, 1, heads, 1).expand(rows, s_q, heads, 1)
        weight = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1].nan_to_num()
        out = torch.einsum("bshn,bsnv->bshv", weight, k[..., : kw["head_dim_v"]])
        return out, torch.logsumexp(logits, -1).transpose(1, 2)

    def record(self, fm, kw: dict, out) -> None:
        import torch

        backend, layer_id, ratio, fa_args = self._ctx[-1]
        pool = backend.token_to_kv_pool
        md = backend.forward_metadata.core_attn_metadata
        q, indices, lengths = kw["q"], kw["indices"], kw["topk_length"]
        rows = q.shape[0]

        def same_storage(view, buf) -> bool:
            return view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()

        def rows_equal(got, built) -> bool:
            return torch.equal(got.reshape(rows, -1), built[:rows].reshape(rows, -1))

        checks = {
            "k_cache is the pool's buffer": same_storage(
                kw["k_cache"], pool.get_swa_key_buffer_radix(layer_id)
            ),
            "indices are the backend's": rows_equal(indices, md.swa_page_indices),
            "lengths are the backend's": rows_equal(lengths, md.swa_topk_lengths),
        }
        sink = fa_args["attn_sink"]
        given = kw["attn_sink"]
        checks["sink is the layer's"] = torch.equal(given, sink[: given.shape[0]])
        positions = backend.forward_metadata.core_attn_metadata.positions[:rows].long()
        want = torch.clamp(positions + 1, max=self.window)
        checks["SWA length = min(pos + 1, window)"] = torch.equal(lengths.reshape(-1).long(), want)
        if ratio != 0:
            extra = kw["extra_indices_in_kvcache"]
            extra_len = kw["extra_topk_length"].reshape(-1).long()
            checks["extra cache is the pool's"] = same_storage(
                kw["extra_k_cache"], pool.get_extra_key_buffer(layer_id)
            )
            checks["extra indices are the backend's"] = rows_equal(
                extra, md.sparse_page_indices(ratio)
            )
            checks["extra lengths are the backend's"] = rows_equal(
                extra_len, md.sparse_topk_lengths(ratio)
            )
            # Every compressed entry so far (c4: the indexer's top-k of them). A row with none
            # gets length 1 and index -1, which the kernel skips: nothing from the future.
            n_entries = (positions + 1) // ratio
            if ratio == 4:
                n_entries = n_entries.clamp(max=self.index_topk)
            checks[f"c{ratio} length = entries so far"] = torch.equal(
                extra_len, n_entries.clamp(min=1)
            )
            listed = extra.reshape(rows, -1)
            none_yet = n_entries == 0
            checks[f"c{ratio}: no entry before the first window closes"] = bool(
                (listed[none_yet, 0] == -1).all()
            )
            live = torch.arange(listed.shape[-1])[None, :] < n_entries[:, None]
            checks[f"c{ratio} indices: distinct, in the pool"] = bool(
                (listed[live] >= 0).all()
                and all(
                    len(set(r[m].tolist())) == int(m.sum())
                    for r, m in zip(listed, live, strict=True)
                )
            )
        # The heads the model keeps: upstream pads the torch backend's decode q to 64 heads at
        # TP > 1, and those rows are NaN (the model slices them off).
        kept = min(q.shape[-2], self.native)
        if fm._sm120_default_backend == "torch":  # the kernel is upstream's torch reference
            reference = "the dense reference"
            ref_out, ref_lse = self.dense_attention(kw, pool, layer_id, kept)
        else:
            reference = "upstream's torch reference"
            ref_out, ref_lse = fm._sm120_sparse_decode_fwd(
                kw["q"],
                kw["k_cache"],
                kw["indices"],
                kw["topk_length"],
                kw["attn_sink"],
                kw["head_dim_v"],
                kw["softmax_scale"],
                kw.get("extra_k_cache"),
                kw.get("extra_indices_in_kvcache"),
                kw.get("extra_topk_length"),
            )
        o, r = out[0].float()[..., :kept, :], ref_out.float()[..., :kept, :]
        err = (o - r).abs()
        tol = 1e-2 * r.abs().amax().clamp(min=1.0) + 1e-2 * r.abs()
        lse = out[1].reshape(rows, q.shape[-2], -1)[:, :kept]
        rlse = ref_lse.reshape(rows, -1, lse.shape[-1])[:, :kept]
        finite = rlse.isfinite()
        lse_err = (lse[finite] - rlse[finite]).abs().max().item() if finite.any() else 0.0
        checks[f"output matches {reference}"] = bool((err <= tol).all())
        checks[f"lse matches {reference}"] = lse_err <= 1e-3 and torch.equal(lse.isfinite(), finite)
        self.calls.append(
            {
                "layer": layer_id,
                "ratio": ratio,
                "rows": rows,
                "heads": q.shape[-2],
                "max_err": err.max().item(),
                "lse_err": lse_err,
                "reference": reference,
                "failed": [name for name, ok in checks.items() if not ok],
            }
        )


_WORKER_ENV = "DSV4_CHECK_WORKER"  # the worker's arguments, where _rank reads them


def _rank(server_args, port_args, bench_args, gpu_id, tp_rank):
    """Load the model, run the prefill and the decode steps, write tokens, logits and the
    spied calls (one_batch's correctness_test calling convention; module level, so that a
    spawned TP rank could run it too)."""
    import torch
    from sglang.benchmark import one_batch as ob
    from sglang.srt.runtime_context import override_platform

    job = json.loads(os.environ[_WORKER_ENV])
    cfg = json.loads((Path(job["model"]) / "config.json").read_text())
    ids, forced = job["ids"], job["forced"]
    spy = KernelSpy(
        window=cfg["window_size"],
        index_topk=cfg["index_topk"],
        native=cfg["num_attention_heads"] // server_args.tp_size,
    )
    with override_platform(is_sm120=True):
        ob.publish(
            server_args,
            role="scheduler",
            ranks=ob.SpawnRanks(
                world_rank=ob.spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0),
                gpu_id=gpu_id,
            ),
        )
        ob._init_process_global_configs()
        if job.get("kill_rank") == tp_rank:  # fault injection (tests): this rank dies here
            os._exit(3)
        runner, _ = ob.load_model(server_args, port_args, gpu_id, tp_rank)
        spy.install()
        replay = torch.load(job["replay"]) if job.get("replay") else None
        spy.record_routing(runner.torch_runner.model, replay)
        if job.get("perturb"):  # fault injection (tests): noise on one weight, sglang only
            _perturb(runner.torch_runner.model, job["perturb"])
        reqs = ob.prepare_synthetic_inputs_for_latency_test(1, len(ids), custom_inputs=[ids])
        t0 = time.monotonic()
        next_ids, logits, batch = runner.extend(reqs)
        tokens, all_logits = [int(next_ids[0])], [logits[0].float().clone()]
        for step in range(job["steps"]):
            feed = tokens[-1] if forced is None else forced[step]
            next_ids, logits = runner.decode(torch.tensor([feed]), batch)
            tokens.append(int(next_ids[0]))
            all_logits.append(logits[0].float().clone())
        entries = spy.entries()
        runner.cleanup(batch)
    result = {
        "rank": tp_rank,
        "tokens": tokens,
        "logits": torch.stack(all_logits),
        "calls": spy.calls,
        "entries": entries,
        "routes": spy.routes(),
        "router_scores": spy.router_scores(),
        "route_flips": spy.flips,
        "triton": spy.triton,
        "seconds": time.monotonic() - t0,
    }
    torch.save(result, f"{job['out']}.rank{tp_rank}")


class RankDied(Exception):
    pass


class RankProcess(multiprocessing.Process):
    """A multiprocessing.Process for one_batch's rank loop whose join() watches its siblings:
    when one rank exits with an error (or the run passes `timeout`), every rank is killed and
    RankDied names the rank, where one_batch's plain join() would wait for ever on a rank
    blocked in a gloo collective that its dead peer never joins. Module level: the ranks are
    spawned, and the process object is pickled."""

    started: list = []
    timeout = 900.0
    deadline = float("inf")

    def start(self):
        super().start()
        RankProcess.started.append(self)

    def join(self, timeout=None):
        started = RankProcess.started
        while self.is_alive():
            dead = [(r, p.exitcode) for r, p in enumerate(started) if p.exitcode]
            late = time.monotonic() > RankProcess.deadline
            if dead or late:
                for p in started:
                    if p.is_alive():
                        p.kill()
                        multiprocessing.Process.join(p)
                if dead:
                    rank, code = dead[0]
                    how = f"signal {-code}" if code < 0 else f"exit {code}"
                    raise RankDied(f"TP rank {rank} died ({how}); the other ranks were killed")
                limit = RankProcess.timeout
                raise RankDied(f"the TP ranks did not finish in {limit:.0f} s; killed")
            super().join(0.5)
        if self.exitcode:
            raise RankDied(f"TP rank {started.index(self)} died (exit {self.exitcode})")


def _perturb(model, part: str) -> None:
    """Add noise (half the weight's std, seeded) to the first parameter whose name contains
    `part`: an error in sglang's path that the reference does not share."""
    import torch

    for name, param in model.named_parameters():
        if part in name:
            gen = torch.Generator().manual_seed(0)
            noise = torch.randn(param.shape, generator=gen) * param.float().std() * 0.5
            with torch.no_grad():
                param.add_(noise.to(param.dtype))
            print(f"dsv4_check: perturbed {name}", flush=True)
            return
    raise ValueError(f"--perturb {part!r}: no parameter name contains it")


def worker(args: argparse.Namespace) -> int:
    """One backend's run, through one_batch's main() (which resolves the server args and, at
    TP > 1, starts one process per rank)."""
    import types

    from sglang.benchmark import one_batch as ob
    from sglang.srt.server_args import ServerArgs

    os.environ[_WORKER_ENV] = json.dumps(
        {
            "model": str(args.model),
            "ids": json.loads(args.prompt_ids),
            "forced": json.loads(args.forced) if args.forced else None,
            "steps": args.steps,
            "out": args.out,
            "kill_rank": args.kill_rank,
            "perturb": args.perturb,
            "replay": args.replay,
        }
    )
    if args.tp > 1:
        RankProcess.timeout = args.timeout
        RankProcess.deadline = time.monotonic() + args.timeout
        ob.multiprocessing = types.SimpleNamespace(Process=RankProcess)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ob.BenchArgs.add_cli_args(parser)
    cli = parser.parse_args(
        [
            "--model-path", str(args.model), "--device", "cpu", "--disable-cuda-graph",
            "--sampling-backend", "pytorch", "--dsa-topk-backend", "torch",
            "--max-total-tokens", "8192",
            "--swa-full-tokens-ratio", "0.5", "--max-running-requests", "4",
            "--batch-size", "1", "--correctness-test", "--log-level", "warning",
            "--tp-size", str(args.tp),
        ]
    )  # fmt: skip
    ob.correctness_test = _rank  # main() resolves the server args, then calls this
    try:
        ob.main(ServerArgs.from_cli_args(cli), ob.BenchArgs.from_cli_args(cli))
    except RankDied as err:
        print(f"dsv4_check: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


def threads_bind(tp: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `tp` ranks on this process's CPUs: contiguous groups,
    one per rank ("0|1" for two ranks on two cores). sglang's CPU thread binding otherwise
    asserts one NUMA node per rank (srt/utils/numa_utils.py), which one-node machines fail."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise BadInput(f"--tp {tp}: this process may run on {len(cpus)} CPU(s), fewer than ranks")
    size = len(cpus) // tp
    groups = [cpus[r * size : (r + 1) * size] for r in range(tp)]
    return "|".join(str(g[0]) if len(g) == 1 else ",".join(str(c) for c in g) for g in groups)


def run_backend(
    backend: str,
    model: Path,
    ids,
    steps,
    forced,
    out: Path,
    timeout: float,
    tp: int = 1,
    kill_rank: int | None = None,
    perturb: str | None = None,
    replay: Path | None = None,
) -> list[dict]:
    """One backend's run at TP `tp` in a fresh process (and its ranks' processes): each rank's
    result, rank 0 first. With `replay` (a file of a reference run's expert choices), its
    top-k routers take those experts (`KernelSpy.record_routing`). The whole process group is
    killed on a timeout or a failure."""
    import signal

    env = {**os.environ, **CPU_ENV, "SGLANG_SM120_FLASHMLA_BACKEND": backend}
    if tp > 1 and not env.get("SGLANG_CPU_OMP_THREADS_BIND"):
        env["SGLANG_CPU_OMP_THREADS_BIND"] = threads_bind(tp)
    cmd = [
        sys.executable, __file__, "--worker", "--model", str(model), "--steps", str(steps),
        "--prompt-ids", json.dumps(ids), "--out", str(out), "--tp", str(tp),
        "--timeout", str(timeout),
    ]  # fmt: skip
    if forced is not None:
        cmd += ["--forced", json.dumps(forced)]
    if kill_rank is not None:
        cmd += ["--kill-rank", str(kill_rank)]
    if perturb:
        cmd += ["--perturb", perturb]
    if replay is not None:
        cmd += ["--replay", str(replay)]
    name = backend if tp == 1 else f"{backend} TP{tp}"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout + 30)  # the worker's own watch comes first
    except subprocess.TimeoutExpired:
        output = ""
        proc.returncode = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks, whatever state they are in
        except ProcessLookupError:
            pass
        proc.wait()
    paths = [Path(f"{out}.rank{r}") for r in range(tp)]
    if proc.returncode is None:
        raise RuntimeError(f"the {name} run did not finish in {timeout + 30:.0f} s; killed")
    if proc.returncode != 0 or not all(p.exists() for p in paths):
        tail = "\n".join(output.strip().splitlines()[-25:])
        raise RuntimeError(f"the {name} run failed (exit {proc.returncode}):\n{tail}")
    import torch

    ranks = [torch.load(p, weights_only=False) for p in paths]
    for res in ranks:
        res["wall"] = time.monotonic() - t0
    return ranks


# --- transformers' DSV4 --------------------------------------------------------------------


def transformers_logits(
    model: Path, tokens: list[int], positions: range, fp8_kv: bool, entries: dict | None = None,
    routes: dict | None = None, flips: list | None = None, scores: dict | None = None,
):  # fmt: skip
    """Logits at `positions` of transformers' DSV4 on `tokens`, float32; with fp8_kv the
    attention's KV nope part is quantized to FP8 e4m3 with UE8M0 tile scales, as sglang's pool
    stores it (the rope part stays bf16-exact in float32 here). With `entries` (a dict), each
    compressing layer's compressed entries land there, keyed as KernelSpy.entries keys them.

    With `routes` (sglang's expert choice, {layer: [tokens, k]}), every top-k router takes
    sglang's experts: where its own choice differs, the token is appended to `flips` with its
    margin for its own pick (`route_flip`), and it takes sglang's experts weighted by its own
    scores as its router weights any choice. `scores` (a dict) receives each such router's
    ranking scores, {layer: [tokens, experts]}."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    hooks = []
    if routes is not None:
        for i, layer in enumerate(hf.model.layers):
            gate = layer.mlp.gate
            if i not in routes or getattr(layer.mlp, "is_hash", False):
                continue  # a hash layer's choice is the token id's, on both sides

            def route(m, args, out, i=i):
                logits, weights, idx = out
                own = m.score_fn(logits)
                ranked = own + m.e_score_correction_bias
                if scores is not None:
                    scores[i] = ranked.detach().float()
                sg = routes[i][: idx.shape[0]]
                idx, weights = idx.clone(), weights.clone()
                for t in range(idx.shape[0]):
                    mine = set(idx[t].tolist())
                    theirs = {e for e in sg[t].tolist() if e < m.num_experts}  # no shared slot
                    if mine == theirs:
                        continue
                    if flips is not None:
                        flips.append(route_flip(ranked[t], mine, theirs, i, t))
                    idx[t] = torch.tensor(sorted(theirs))
                    w = own[t, idx[t]]
                    weights[t] = w / (w.sum() + 1e-20) * m.routed_scaling_factor
                return logits, weights, idx

            hooks.append(gate.register_forward_hook(route))
    if fp8_kv:
        quant = _fp8_round_trip
        for layer in hf.model.layers:
            attn = layer.self_attn
            hooks.append(attn.kv_norm.register_forward_hook(lambda m, i, o: quant(o)))
    if entries is not None:
        for i, layer in enumerate(hf.model.layers):
            comp = getattr(layer.self_attn, "compressor", None)
            if comp is None:
                continue

            def main_kv(m, args, out, key=f"{i}:kv"):
                entries[key] = out[0][0, 0].detach().float()  # [B, 1, T, 512] -> [T, 512]

            hooks.append(comp.register_forward_hook(main_kv))
            if getattr(comp, "indexer", None) is not None:

                def index_k(m, args, key=f"{i}:index"):
                    entries[key] = args[1][0].detach().float()  # scorer(q, [B, T, 128], h)

                hooks.append(comp.indexer.scorer.register_forward_pre_hook(index_k))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([tokens])).logits[0]
    for h in hooks:
        h.remove()
    return out[list(positions)].float()


def compare_entries(sg: dict, hf: dict, n_tokens: int) -> tuple[list[str], list[str]]:
    """sglang's compressed entries (read back from its pools) against transformers', entry by
    entry: (lines, failures). Every entry of the fed tokens must be there, once."""
    import torch

    lines, failures = [], []
    for key in sorted(hf, key=lambda k: (int(k.split(":")[0]), k)):
        ref = hf[key]
        got = sg.get(key)
        if got is None:
            failures.append(f"layer {key}: sglang stored no compressed entry")
            continue
        ratio = got["ratio"]
        want = list(range(n_tokens // ratio))
        if sorted(got["entry"]) != want:
            failures.append(f"layer {key} (c{ratio}): entries stored {sorted(got['entry'])}, "
                            f"expected 0..{len(want) - 1}")  # fmt: skip
            continue
        value = got["value"][torch.tensor(got["entry"]).argsort()]
        cos = torch.nn.functional.cosine_similarity(value, ref[: len(want)], dim=-1)
        rel = ((value - ref[: len(want)]).abs().amax(-1) / ref[: len(want)].abs().amax(-1)).max()
        lines.append(f"layer {key:<8} c{ratio:<3} {len(want):>3} entries: worst cos "
                     f"{cos.min().item():.5f} (entry {int(cos.argmin())}), max |diff| / max "
                     f"{rel.item():.4f}")  # fmt: skip
        worst = cos.min().item()
        if worst < ENTRY_MIN_COS:
            failures.append(f"layer {key} (c{ratio}): entry {int(cos.argmin())} cos "
                            f"{worst:.5f} < {ENTRY_MIN_COS} against transformers'")  # fmt: skip
    return lines, failures


def _fp8_round_trip(kv):
    """kv [..., 512]: the first 448 values through FP8 e4m3 with a UE8M0 scale per 64, the rope
    part rounded to bf16, as sglang's V4 pool stores a row."""
    import torch

    nope, rope = kv[..., :448], kv[..., 448:]
    tiles = nope.reshape(-1, 7, 64)
    scale_raw = tiles.abs().amax(-1).clamp_min(1e-4) / 448.0
    scale = torch.exp2(torch.ceil(torch.log2(scale_raw)))
    q = (tiles / scale.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    nope = (q * scale.unsqueeze(-1)).reshape(nope.shape)
    return torch.cat([nope, rope.to(torch.bfloat16).float()], -1).to(kv.dtype)


# --- comparison and report -----------------------------------------------------------------


def compare(a, b) -> dict:
    import torch

    a, b = a.float(), b.float()
    return {
        "max_abs": (a - b).abs().max().item(),
        "cos": torch.nn.functional.cosine_similarity(a, b, dim=-1).item(),
        "top1": int(a.argmax()) == int(b.argmax()),
    }


def _margin(logits) -> float:
    top = logits.float().topk(2).values
    return (top[0] - top[1]).item()


def report(
    ranked: dict, hf: dict, steps: int, layers: int, heads: int, tp: int = 1, tp1=None
) -> tuple[list[str], list[str]]:
    """(table lines, failures). `ranked`: each backend's per-rank results; `tp1`: at TP > 1,
    the mma run at TP1 that the TP run must equal."""
    runs = {name: ranks[0] for name, ranks in ranked.items()}
    mma, torch_run = runs["mma"], runs["torch"]
    failures: list[str] = []
    ties: list[str] = []
    lines = [
        "step  tok mma  tok torch  tok hf | mma-torch max_abs  /std    cos      | "
        "mma-hf(fp8 kv) max_abs  cos     top1 | mma-hf(fp32 kv) cos"
    ]
    for i in range(steps + 1):
        mt = compare(mma["logits"][i], torch_run["logits"][i])
        mh = compare(mma["logits"][i], hf["fp8"][i])
        mh32 = compare(mma["logits"][i], hf["fp32"][i])
        hf_tok = int(hf["fp8"][i].argmax())
        rel = mt["max_abs"] / torch_run["logits"][i].float().std().item()
        lines.append(
            f"{i:>4}  {mma['tokens'][i]:>7}  {torch_run['tokens'][i]:>9}  {hf_tok:>6} | "
            f"{mt['max_abs']:>17.4g}  {rel:.4f}  {mt['cos']:.6f} | {mh['max_abs']:>22.4g}  "
            f"{mh['cos']:.5f}  {'yes' if mh['top1'] else 'NO':>4} | {mh32['cos']:.5f}"
        )
        # A different greedy token is a failure only where the reference's choice is clear:
        # its top-1 leads its top-2 by more than twice the step's max abs diff. Below that the
        # two are tied within the noise the other checks bound, and either pick is right.
        for other, tok, noise in (
            ("torch", torch_run["tokens"][i], mt["max_abs"]),
            ("transformers (fp8 kv)", hf_tok, mh["max_abs"]),
        ):
            ref = torch_run["logits"][i] if other == "torch" else hf["fp8"][i]
            margin = _margin(ref)
            if mma["tokens"][i] == tok:
                continue
            if margin > 2 * noise:
                failures.append(f"step {i}: greedy token mma {mma['tokens'][i]} != {other} "
                                f"{tok}, whose lead is {margin:.4g} (> 2 x {noise:.4g})"
                                )  # fmt: skip
            else:
                ties.append(f"step {i}: mma picks {mma['tokens'][i]}, {other} {tok}: a tie "
                            f"(lead {margin:.4g} <= 2 x max abs diff {noise:.4g})")  # fmt: skip
        if mt["cos"] < MMA_TORCH_MIN_COS or rel > MMA_TORCH_MAX_REL:
            failures.append(f"step {i}: mma vs torch logits cos {mt['cos']:.6f}, max abs "
                            f"{rel:.4f} of their std (limits {MMA_TORCH_MIN_COS}, "
                            f"{MMA_TORCH_MAX_REL})")  # fmt: skip
        if mh["cos"] < HF_MIN_COS:
            failures.append(f"step {i}: mma vs transformers (fp8 kv) cos {mh['cos']:.5f} < "
                            f"{HF_MIN_COS}")  # fmt: skip
    if tp1 is not None:
        more, bad, more_ties = compare_tp1(mma, tp1, steps, tp)
        lines += more
        failures += bad
        ties += more_ties
    native = heads // tp
    for backend, ranks in ranked.items():
        for run in ranks:
            name = backend if tp == 1 else f"{backend} rank {run['rank']}"
            want = layers * (steps + 1)
            if len(run["calls"]) != want:
                failures.append(f"{name}: {len(run['calls'])} kernel calls, expected {want} "
                                f"({layers} layers x {steps + 1} forwards)")  # fmt: skip
            for c in run["calls"]:
                if c["failed"]:
                    failures.append(f"{name}: layer {c['layer']} call ({c['rows']} rows): "
                                    + ", ".join(c["failed"]))  # fmt: skip
            got_heads = sorted({c["heads"] for c in run["calls"]})
            # Patch 0005: the mma backend gets the rank's own heads (upstream pads to 64).
            if backend == "mma" and got_heads != [native]:
                failures.append(f"{name}: the kernel received {got_heads} query heads, expected "
                                f"the rank's native {native} ({heads} / TP{tp})")  # fmt: skip
            if run["tokens"] != mma["tokens"] and backend == "mma":
                failures.append(f"{name}: greedy tokens {run['tokens']} differ from rank 0's "
                                f"{mma['tokens']}")  # fmt: skip
            worst = max((c["max_err"] for c in run["calls"]), default=0.0)
            reference = " and ".join(sorted({c["reference"] for c in run["calls"]}))
            kernels = ", ".join(
                f"{k.rsplit('.', 1)[-1]} x{v}" for k, v in sorted(run["triton"].items())
            )
            lines.append(f"{name}: Triton kernels run (interpreter): {kernels or 'none'}")
            lines.append(
                f"{name}: {len(run['calls'])} kernel calls (expected {want}), query heads "
                f"{'/'.join(map(str, got_heads))} of {heads}, worst |out - {reference}| "
                f"{worst:.3g}, run {run['seconds']:.1f} s ({run['wall']:.1f} s with load)"
            )
    lines += [f"near-tie, not counted: {t}" for t in ties]
    return lines, failures


def compare_tp1(run: dict, tp1: dict, steps: int, tp: int):
    """The TP run's logits and greedy tokens against the TP1 run's (which fed both the same
    tokens): within the kernel's tolerance (the mma-vs-torch limits; TP adds only the
    all-reduce's order of bf16 sums). (lines, failures, near-ties)."""
    lines = [f"step  tok TP{tp}  tok TP1 | TP{tp}-TP1 max_abs  /std    cos"]
    failures, ties = [], []
    for i in range(steps + 1):
        c = compare(run["logits"][i], tp1["logits"][i])
        rel = c["max_abs"] / tp1["logits"][i].float().std().item()
        lines.append(f"{i:>4}  {run['tokens'][i]:>7}  {tp1['tokens'][i]:>7} | "
                     f"{c['max_abs']:>16.4g}  {rel:.4f}  {c['cos']:.6f}")  # fmt: skip
        if c["cos"] < MMA_TORCH_MIN_COS or rel > MMA_TORCH_MAX_REL:
            failures.append(f"step {i}: TP{tp} vs TP1 logits cos {c['cos']:.6f}, max abs "
                            f"{rel:.4f} of their std (limits {MMA_TORCH_MIN_COS}, "
                            f"{MMA_TORCH_MAX_REL})")  # fmt: skip
        if run["tokens"][i] != tp1["tokens"][i]:
            margin = _margin(tp1["logits"][i])
            msg = (f"step {i}: greedy token TP{tp} {run['tokens'][i]} != TP1 "
                   f"{tp1['tokens'][i]}, whose lead is {margin:.4g}")  # fmt: skip
            if margin > 2 * c["max_abs"]:
                failures.append(f"{msg} (> 2 x {c['max_abs']:.4g})")
            else:
                ties.append(f"{msg}: a tie (<= 2 x max abs diff {c['max_abs']:.4g})")
    return lines, failures, ties


def routing_report(ranked: dict, tp1, first: str, hf_flips: dict, hf_scores: dict, tp: int):
    """The routing replay's record: each run's tokens whose own router would have picked other
    experts than the ones it took (sglang's later runs take the first run's, transformers takes
    sglang's). A margin of at most ROUTER_TIE_MAX is a near-tie, printed; a wider one fails: the
    router's inputs differ, an error upstream of that layer's MoE. Also each router's ranking
    scores, sglang's first run against transformers' (FP8 KV) on the same tokens and experts.
    (record, lines, failures)."""
    named = []
    for backend, ranks in ranked.items():
        for run in ranks:
            if run["rank"] and run["route_flips"] == ranks[0]["route_flips"]:
                continue  # a TP rank routes on the same all-reduced input as rank 0
            rank = f" rank {run['rank']}" if run["rank"] else ""
            named.append((backend if tp == 1 else f"{backend} TP{tp}{rank}", run["route_flips"]))
    # transformers with FP8-rounded KV is the reference sglang's routers are held to; without
    # the rounding it takes the same experts, its flips recorded for scale only.
    named.append(("transformers", hf_flips["fp8"]))
    record: dict = {"flips": {}, "score_diff": {}}
    lines, failures = [], []
    for name, flips in named:
        if not flips:
            continue
        record["flips"][name] = flips
        source = f"sglang's {first} run" if name == "transformers" else f"the {first} run"
        for f in flips:
            where = (f"layer {f['layer']} token {f['token']}: its router picks experts "
                     f"{f['own']}, {source} took {f['reference']}")  # fmt: skip
            if f["margin"] <= ROUTER_TIE_MAX:
                lines.append(f"router near-tie, {name} takes {source}'s experts: {where}, "
                             f"margin {f['margin']:.4g} <= {ROUTER_TIE_MAX}")  # fmt: skip
            else:
                failures.append(f"{name}: {where}, by a margin {f['margin']:.4g} > "
                                f"{ROUTER_TIE_MAX}: the router's inputs differ (an error "
                                "upstream of this layer's MoE)")  # fmt: skip
    sg_scores = (tp1 or ranked["mma"][0])["router_scores"]
    for layer in sorted(hf_scores):
        if layer in sg_scores:
            diff = (sg_scores[layer] - hf_scores[layer][: len(sg_scores[layer])]).abs().max()
            record["score_diff"][layer] = diff.item()
            if diff.item() > ROUTER_SCORE_MAX_DIFF:
                failures.append(f"layer {layer}: sglang's router scores differ from "
                                f"transformers' by up to {diff.item():.4g} > "
                                f"{ROUTER_SCORE_MAX_DIFF} over {len(sg_scores[layer])} tokens: "
                                "the router's inputs or weights differ")  # fmt: skip
    if hf_flips["fp32"]:
        record["flips"]["transformers (fp32 kv)"] = hf_flips["fp32"]
        lines.append(f"transformers without the FP8 KV rounding (for scale) takes sglang's experts "
                     f"at {len(hf_flips['fp32'])} tokens, margins up to "
                     f"{max(f['margin'] for f in hf_flips['fp32']):.4g} (not checked)")  # fmt: skip
    if record["score_diff"]:
        lines.append(f"router ranking scores, sglang's {first} run vs transformers (fp8 kv), max "
                     "|diff| per layer: " + ", ".join(f"layer {k} {v:.4g}" for k, v in
                                                      record["score_diff"].items()))  # fmt: skip
    return record, lines, failures


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/dsv4_check",
        description="Run a tiny DeepSeek-V4 through sglang's real model path on CPU into the "
        "mma kernel (Triton interpreter); check each kernel call and the logits against "
        "upstream's torch backend and transformers' DSV4.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="a DSV4 model directory (default: --standard)")
    src.add_argument(
        "--standard",
        choices=("swa", "c4c128"),
        default="swa",
        help="the standard tiny model, made or reused by tools/make_tiny_model.py (default: swa)",
    )
    p.add_argument(
        "--prompt-len",
        type=int,
        help="prompt tokens, seeded (default: 160, longer than the 128-token window; 252 for a "
        "model with a c128 layer, so that the decode steps close a c128 window at 256)",
    )
    p.add_argument("--steps", type=int, default=6, help="decode steps (default: 6)")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (gloo, one process each); above 1 the mma run at TP1 is "
        "the reference the TP run's logits and tokens must equal (default: 1). Each rank gets "
        "its CPUs from SGLANG_CPU_OMP_THREADS_BIND, or this process's CPUs split evenly",
    )
    p.add_argument("--seed", type=int, default=1, help="prompt seed (default: 1)")
    p.add_argument(
        "--timeout", type=float, default=900, help="seconds for each backend's run (default: 900)"
    )
    p.add_argument("--json", type=Path, help="write the per-step numbers and calls here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    p.add_argument("--forced", help=argparse.SUPPRESS)
    p.add_argument("--kill-rank", type=int, help=argparse.SUPPRESS)  # fault injection
    p.add_argument("--perturb", help=argparse.SUPPRESS)  # fault injection
    p.add_argument("--replay", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)  # fmt: skip
    if (args.prompt_len is not None and args.prompt_len < 2) or args.steps < 1:
        p.error("--prompt-len must be >= 2 and --steps >= 1")
    if args.tp < 1:
        p.error("--tp must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from tools.entry import require

    # Before any work (the model is made in a child process): what the check itself imports.
    require("bench/dsv4_check", "torch", "transformers", "sglang", script=str(Path(__file__)))
    if args.worker:
        return worker(args)
    try:
        model = args.model or standard_model(args.standard)
        cfg = check_model_dir(model)
    except BadInput as err:
        return _fail(str(err))
    if args.prompt_len is None:
        args.prompt_len = 252 if 128 in cfg["compress_ratios"] else 160
    heads = cfg["num_attention_heads"]
    if heads % args.tp:
        return _fail(f"--tp {args.tp}: the model's {heads} query heads do not split evenly")
    ids = prompt_ids(cfg, args.prompt_len, args.seed)
    layers = len(cfg["compress_ratios"])
    print(f"dsv4_check: {model.name}: layers {cfg['compress_ratios']}, "
          f"{heads} heads, prompt {len(ids)} tokens, {args.steps} decode steps"
          + (f", TP{args.tp}" if args.tp > 1 else ""), flush=True)  # fmt: skip
    ranked: dict = {}
    tp1 = None
    topk = cfg.get("num_experts_per_tok", 0) < cfg.get("n_routed_experts", 0)
    # At TP > 1 the mma run at TP1 goes first: the TP runs are fed its greedy tokens. With top-k
    # routing, every later run also takes the first run's expert choices (replayed, each token
    # where its own router differs noted with its margin), so that two runs differ only in
    # their kernels and TP, not in which side of a router near-tie their rounding landed on.
    plan = ([("mma", 1)] if args.tp > 1 else []) + [(b, args.tp) for b in BACKENDS]
    first = "mma TP1" if args.tp > 1 else "mma"
    with tempfile.TemporaryDirectory(prefix="dsv4_check.") as tmp:
        replay = None
        for backend, tp in plan:
            lead = tp1 or ranked.get("mma", [None])[0]
            forced = None if lead is None else lead["tokens"][: args.steps]
            where = f" at TP{tp}" if args.tp > 1 else ""
            print(f"dsv4_check: sglang with the {backend} backend{where} ...", flush=True)
            try:
                got = run_backend(
                    backend, model, ids, args.steps, forced,
                    Path(tmp) / f"{backend}-tp{tp}.pt", args.timeout, tp=tp,
                    kill_rank=args.kill_rank, perturb=args.perturb, replay=replay,
                )  # fmt: skip
            except (RuntimeError, BadInput) as err:
                print(f"dsv4_check: {err}", file=sys.stderr)
                return 1
            if topk and replay is None:
                import torch

                replay = Path(tmp) / "routes.pt"
                torch.save(got[0]["routes"], replay)
            if tp == args.tp:
                ranked[backend] = got
            else:
                tp1 = got[0]
    runs = {name: ranks[0] for name, ranks in ranked.items()}
    reference_run = tp1 or runs["mma"]
    print("dsv4_check: transformers' DSV4 (float32) ...", flush=True)
    tokens = ids + reference_run["tokens"][: args.steps]
    at = range(len(ids) - 1, len(ids) + args.steps)
    # transformers takes the same expert choices (the first run's) in both references.
    routes = reference_run["routes"] if topk else None
    hf_entries: dict = {}
    hf_flips: dict = {"fp8": [], "fp32": []}
    hf_scores: dict = {}
    hf = {
        "fp8": transformers_logits(model, tokens, at, fp8_kv=True, routes=routes,
                                   flips=hf_flips["fp8"], scores=hf_scores),
        "fp32": transformers_logits(model, tokens, at, fp8_kv=False, entries=hf_entries,
                                    routes=routes, flips=hf_flips["fp32"]),
    }  # fmt: skip
    lines, failures = report(ranked, hf, args.steps, layers, heads, args.tp, tp1)
    routing, more, bad = routing_report(ranked, tp1, first, hf_flips, hf_scores, args.tp)
    lines += more
    failures += bad
    if hf_entries:
        lines.append("compressed entries, mma run vs transformers' compressors:")
        for backend in BACKENDS:
            more, bad = compare_entries(runs[backend]["entries"], hf_entries, len(tokens))
            if backend == "mma":
                lines += ["  " + line for line in more]
            failures += [f"{backend}: {b}" for b in bad]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": str(model),
                    "prompt_len": len(ids),
                    "prompt_ids": ids,
                    "steps": args.steps,
                    "tp": args.tp,
                    "tp1_tokens": tp1["tokens"] if tp1 else None,
                    "routing": routing,
                    "ranks": {
                        k: [{f: r[f] for f in ("rank", "tokens", "calls", "triton")} for r in v]
                        for k, v in ranked.items()
                    },
                    "tokens": {k: v["tokens"] for k, v in runs.items()},
                    "calls": {k: v["calls"] for k, v in runs.items()},
                    "triton": {k: v["triton"] for k, v in runs.items()},
                    "failures": failures,
                },
                indent=1,
            )
        )
    if failures:
        print("dsv4_check: FAIL\n  " + "\n  ".join(failures))
        return 1
    print("dsv4_check: PASS")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tools.entry import call

    # A dependency main() imports and this Python lacks ends in one line naming it, exit 2.
    call("bench/dsv4_check", main)
