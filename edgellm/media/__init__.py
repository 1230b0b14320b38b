"""Images and audio for multimodal prompts: where the bytes come from, how they are decoded, what the
engine receives. Framework-agnostic (no FastAPI, no llama.cpp): the API process and `edgellm infer`
decode here, the engine's projector (engine/projector.py) only sees the decoded inputs."""
