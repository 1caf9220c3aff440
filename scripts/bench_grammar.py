"""Constrained-decoding libraries compared on the default model's vocabulary (SmolLM2-135M,
49,152 tokens): llguidance, xgrammar and outlines-core, each with its own defaults.
  - vocabulary: building the library's view of the vocabulary from the HF tokenizer (median of 3)
  - compile: turning a nested JSON schema into the library's grammar/index (median of 5)
  - mask: the allowed-token bitmask at each position of a fixed valid document, advancing by the
    document's own tokens, plus the final mask (where EOS must be allowed); median and p90 in
    microseconds per token over 5 fresh matchers
  - accepted: every document token was in its mask and consumed, and EOS was allowed at the end
Prints a table and writes JSON (default docs/bench/grammar.json).

Only llguidance is a project dependency (chosen on these figures: engines/grammar.py), so the
comparison runs in a scratch venv:
  .venv/bin/python -m venv /tmp/grammar-venv
  /tmp/grammar-venv/bin/pip install llguidance==1.9.1 xgrammar outlines-core transformers \
      tokenizers numpy torch==2.13.0
  /tmp/grammar-venv/bin/python scripts/bench_grammar.py --tokenizer MODEL_DIR
--tokenizer defaults to the directory models.toml resolves the default model to, which works only
where the project's own dependencies are importable (not in the scratch venv).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"type": "object", "required": ["title", "stars"], "additionalProperties": False,
           "properties": {"title": {"type": "string", "maxLength": 30},
                          "stars": {"type": "integer"}}}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "nickname": {"type": "string", "maxLength": 20},
        "projects": {"type": "array", "maxItems": 4, "items": PROJECT},
    },
    "required": ["name", "age", "role", "projects"],
    "additionalProperties": False,
}
# "nickname" is left out, so the matchers must keep the optional branch open and then drop it.
DOCUMENT = json.dumps({
    "name": "Ada Lovelace", "age": 36, "role": "admin",
    "projects": [{"title": "Analytical Engine notes", "stars": 5},
                 {"title": "Poetical science", "stars": 3}],
})
NOTES = [
    ("llguidance builds its lexer and parser lazily, so its compile time is small and the work "
     "shows up in the mask times instead; xgrammar and outlines-core precompute per-token tables."),
    ("Whitespace defaults differ: llguidance and xgrammar allow flexible JSON whitespace, "
     "outlines-core's regex allows one optional space, so its masks hold fewer tokens."),
    ("outlines-core's vocabulary time includes decoding byte-level token strings in Python, "
     "which any integration needs since its only other constructor downloads from the Hub."),
]


def default_tokenizer_dir() -> str | None:
    try:
        sys.path.append(str(ROOT))
        from engines.models.config import load_models_file
        from engines.models.sources import resolve_model_dir
        from server.settings import REPO_MODELS_FILE

        specs = load_models_file(REPO_MODELS_FILE)
        spec = next(s for s in specs if s.id == "smollm2-135m-instruct")
        return str(resolve_model_dir(spec, show_progress=False))
    except Exception:  # noqa: BLE001 - any failure just means the flag is needed
        return None


def llguidance_adapter(hf, n_vocab):
    import llguidance
    import llguidance.hf

    def new_matcher(tok):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def matcher(tok):
        # There is no compiled object apart from a matcher, so each run builds its own, as a
        # server would per request.
        m = new_matcher(tok)
        return m.compute_bitmask, lambda t: m.consume_token(t) and not m.is_error()

    vocabulary = lambda: llguidance.hf.from_tokenizer(hf, n_vocab)
    return "llguidance", vocabulary, lambda tok: new_matcher(tok) and tok, matcher


def xgrammar_adapter(hf, n_vocab):
    import xgrammar as xgr

    def compile_(info):
        # Its cache would turn the repeats into look-ups.
        return xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(SCHEMA)

    def matcher(compiled):
        m, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, n_vocab)

        def mask():
            m.fill_next_token_bitmask(bitmask)
            return bitmask
        return mask, m.accept_token

    vocabulary = lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=n_vocab)
    return "xgrammar", vocabulary, compile_, matcher


def outlines_core_adapter(hf, n_vocab):
    import outlines_core as oc

    def vocabulary():
        # Vocabulary wants each token's raw bytes; GPT-2 byte-level BPE spells bytes that are not
        # printable as characters from 256 on.
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        shifted = [b for b in range(256) if b not in printable]
        byte_of = {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(shifted)}
        added, tokens = hf.added_tokens_decoder, {}
        for text, i in hf.get_vocab().items():
            if i in added and added[i].special:
                continue  # EOS is passed on its own; the other specials never occur in JSON
            raw = added[i].content.encode() if i in added else bytes(byte_of[c] for c in text)
            tokens.setdefault(raw, []).append(i)
        return oc.Vocabulary(hf.eos_token_id, tokens)

    def compile_(vocab):
        return oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA)), vocab)

    def matcher(index):
        guide, bitmask = oc.Guide(index), np.zeros((n_vocab + 31) // 32, dtype=np.int32)

        def mask():
            guide.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)
            return bitmask

        def consume(t):
            guide.advance(t, return_tokens=False)  # raises on a token the state does not allow
            return True
        return mask, consume

    return "outlines-core", vocabulary, compile_, matcher


def allowed(mask, token: int) -> bool:
    # All three lay out bit t of the mask as bit t % 8 of byte t // 8.
    raw = np.frombuffer(mask, np.uint8) if isinstance(mask, bytes) else np.asarray(mask)
    return bool(raw.view(np.uint8).ravel()[token >> 3] >> (token & 7) & 1)


def timed(fn, n):
    times, result = [], None
    for _ in range(n):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def bench(adapter, hf, n_vocab, doc_ids):
    name, vocabulary, compile_, matcher = adapter(hf, n_vocab)
    vocab_s, vocab = timed(vocabulary, 3)
    compile_s, compiled = timed(lambda: compile_(vocab), 5)
    per_token, failure = [], None
    for _ in range(5):
        mask, consume = matcher(compiled)
        for pos, tok in enumerate(doc_ids + [hf.eos_token_id]):
            start = time.perf_counter()
            m = mask()
            per_token.append((time.perf_counter() - start) * 1e6)
            if not allowed(m, tok):
                failure = failure or f"token {pos} ({tok}) not in its mask"
            if pos == len(doc_ids):
                break  # EOS only has to be allowed
            try:
                ok = consume(tok)
            except Exception as exc:  # noqa: BLE001 - outlines-core rejects by raising
                ok, failure = False, failure or f"token {pos} ({tok}): {exc}"
            if not ok:
                failure = failure or f"token {pos} ({tok}) rejected"
                break
    return {"library": name, "version": metadata.version(name), "vocab_build_s": vocab_s,
            "schema_compile_s": compile_s, "mask_us_median": statistics.median(per_token),
            "mask_us_p90": statistics.quantiles(per_token, n=10)[8],
            "accepted": failure is None, "failure": failure}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", help="HF tokenizer directory (default: the default model's)")
    p.add_argument("--out", default=str(ROOT / "docs/bench/grammar.json"))
    args = p.parse_args()
    args.tokenizer = args.tokenizer or default_tokenizer_dir()
    if not args.tokenizer:  # the scratch venv lacks the project's dependencies
        p.error("--tokenizer is required: the project's models.toml cannot be resolved here")
    hf = AutoTokenizer.from_pretrained(args.tokenizer)
    n_vocab = len(hf)
    doc_ids = hf(DOCUMENT, add_special_tokens=False)["input_ids"]
    rows = []
    for adapter in (llguidance_adapter, xgrammar_adapter, outlines_core_adapter):
        try:
            rows.append(bench(adapter, hf, n_vocab, doc_ids))
        except Exception as exc:  # noqa: BLE001 - a library that fails is a row, not a stop
            library = adapter.__name__.removesuffix("_adapter").replace("_", "-")
            rows.append({"library": library, "skipped": f"{type(exc).__name__}: {exc}"})

    head = (f"{'library':<14} {'version':<8} {'vocab s':>8} {'compile s':>10} "
            f"{'mask us med':>12} {'p90':>8}  accepted")
    print(f"{n_vocab} tokens, document of {len(doc_ids)} tokens\n{head}\n{'-' * len(head)}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['library']:<14} skipped: {r['skipped']}")
            continue
        print(f"{r['library']:<14} {r['version']:<8} {r['vocab_build_s']:>8.3f} "
              f"{r['schema_compile_s']:>10.4f} {r['mask_us_median']:>12.1f} "
              f"{r['mask_us_p90']:>8.1f}  {'yes' if r['accepted'] else r['failure']}")

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    out = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "cpu": cpu,
           "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
           "transformers": metadata.version("transformers"), "tokenizer": args.tokenizer,
           "vocab_size": n_vocab, "document_tokens": len(doc_ids), "schema": SCHEMA,
           "document": DOCUMENT, "notes": NOTES, "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
