"""Tools around artifacts: inspect (report), eval, plan (with its cost model), bench (with its engines and
worker process), synthetic benchmark models and the ONNX Runtime reference."""
