"""Tools around artifacts, one CLI subcommand each, with the modules they are built from:

* inspect: ``report`` (the summary), ``graph_export`` (the graph as ONNX / DOT);
* eval: ``evaluate`` ← ``eval_inputs`` (files, tasks), ``eval_scoring`` (running the graph), ``eval_sweep``;
* plan: ``plan`` ← ``costmodel`` ← ``plan_inputs`` (profiles, assumptions) ← ``model_shapes``;
* bench: ``bench`` (the run) → ``bench_report``; ``engines`` (+ the ``engine_worker`` process), ``traffic``
  (bytes per token);
* ``synthetic`` (checkpoints) ← ``synthetic_model`` (the generator); ``ort_reference`` (dense ONNX Runtime).
"""
