"""The artifact contract export writes and runtime reads, the floor below both: manifest.json and its records
(manifest, records, cache_records, artifact_files), the graph I/O contract (graph_contract), the weights file
and its dtypes (weights), what a target promises a runtime (targets), the checks of a graph before it loads
(onnx_check), the TensorRT engines' I/O (trt_engines), the LoRA slots and PEFT adapter folders (lora_layout,
peft, safetensors_file) and the version stamped into every manifest. It imports neither export nor runtime."""
