"""The serving benchmark (`python3 bench/stack.py STEP ...`, or `python3 -m bench.stack STEP ...` from the
project root), by what each module holds:

  server.py    a server's state folder, `vllm serve` command and environment, boot / wait / stop
  measure.py   the steps against a serving label: stress, decode, steps, logprobs, continuation, compare
  collect.py   what a server left (summary, reports, result files, log) into $OUT/LABEL or a bundle
  merge.py     `merge`: runs from folders or bundles into one result, with comparisons and verdicts
  verdicts.py  the series' verdicts: tqspec, memory, release
  series.py    the series' definitions and `series`: queues per GPU, resume, status, verdicts
  schedule.py  one GPU's queue of labels: boots, steps within the deadline, second boots, warm-up
  windows.py   servers side by side on one GPU: stagger gate, profiling windows, quiet GPU
  cli.py       the command line (argparse) and main()
"""
