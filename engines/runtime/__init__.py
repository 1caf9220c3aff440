"""The runtime: one scheduler and step loop per loaded model, over any step executor.

Engines execute steps (a plan of sequences to prefill and decode in, one sampled token per
sequence out); everything about requests lives here, once for every engine: admission, KV
accounting, chunked prefill, detokenizing, stop strings, finish reasons and per-request stats.
"""
