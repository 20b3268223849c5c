"""Quantized weights kept in their packed form: the records loaders hand over and the kernels that run them.

The contract (docs/quantization.md tells it to users):

1. A loader yields `(hf_name, weight)` where `weight` is a float `torch.Tensor` or, for a weight
   the checkpoint stores quantized, a `QuantizedWeight` (`weights.py`) of its format: packed CPU
   tensors, the logical `shape` (out, in), a `scheme` (`Q4_K`, `int4 g128`, ...), `dequantize()`
   as the format's reference, and the builders below. Component tensors (AWQ's `qweight`,
   `qzeros`, `scales`) are gathered by the format's reader into one record named `<layer>.weight`.
2. A quantized model (`ModelConfig.quantization` set) builds its `Linear`/`MergedLinear` and
   `VocabEmbedding` layers on a "meta" placeholder; `CausalLM.load_weights` routes each weight to
   the layer's `load_part`. When a layer has all its parts it calls
   `build_linear_kernels(parts, device, dtype)`: each run of consecutive parts with equal
   `merge_key` becomes one `LinearKernel` from `type(part).build_linear(run, device, dtype)`, which
   repacks once for the device's kernel (q/k/v stored alike stay one GEMM). Float tensors in a
   quantized model become `FloatWeight` parts (dense GEMM). Embeddings call `build_embedding`.
3. Every kernel has a plain-torch twin with the same arithmetic (in `kvasir.kernels`), and
   `LinearKernel.describe()` names what runs, for the startup log and `/metrics`
   (`report.weights_report` -> `kvasir_model_weight_layers`, `kvasir_model_weight_bytes`).
4. Quantizing float weights while loading (`--quantization fp8` on a float checkpoint) goes
   through `registry.online_quantizer(method)`: a function float tensor -> `QuantizedWeight`,
   applied to the linear layers that allow it (not the LM head).
"""
