"""The engine's text side: sampled tokens in, per-choice deltas of text out (incremental
detokenization, stop strings, logprobs), in the engine's process or in a process of its own
(`--output-process`). `processor.py` is the entry point; `updates.py` the records it consumes;
`detokenizer.py` the incremental decoding; `process.py` the separate process."""
