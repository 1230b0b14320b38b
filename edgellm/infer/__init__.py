"""`edgellm infer`: a TensorRT-Edge-LLM `llm_inference` input JSON, run on the local engine."""

from edgellm.infer.contract import InferBatch, InferInputError, InferItem, InferJob, load_job, parse_job

__all__ = ["InferBatch", "InferInputError", "InferItem", "InferJob", "load_job", "parse_job"]
