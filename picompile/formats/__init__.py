"""File formats: the artifact and its manifest, the activation profile, tokenizers, and the ONNX and GGUF exports."""
