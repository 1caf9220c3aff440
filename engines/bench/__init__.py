"""Benchmarking: the same prompts through duet's engines and the reference systems, timed the
same way.

  core     prompts, run plans, run records, the timing loop, summaries and ratios; no backend
  report   what the numbers were taken on (versions, device names, the host) and where they
           are written (JSON, a marked section of a markdown file)
  systems  duet's engines and the references (transformers generate(), mlx-lm generate_step
           and BatchGenerator) behind one setup / run / teardown shape; the device's ceiling

Imports go one way: core and report import neither of the others, systems imports both.
Backends (torch, transformers, mlx) are imported only when a system is set up.
"""
