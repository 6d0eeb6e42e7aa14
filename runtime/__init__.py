"""Model runtime: engine directories, the tensor-dict model runner over a paged KV pool,
GptSession (static-batch generation) and the kernel backends."""
from .config import BuildConfig, ConfigError, ModelConfig
from .engine import Engine, build_engine
from .loading.gguf_tokenizer import save_gguf_tokenizer
from .models import SUPPORTED_ARCHITECTURES
from .precision import QuantMode
from .greedy_steps import GreedySteps
from .model_runner import KvBlocks, ModelRunner
from .session import GenerationInput, GenerationOutput, GptSession, SamplingConfig
from .parallel.world_config import WorldConfig
from .loading.weights import WeightError

__all__ = ["BuildConfig", "ConfigError", "ModelConfig", "SUPPORTED_ARCHITECTURES", "Engine", "build_engine", "KvBlocks", "GreedySteps",
           "ModelRunner", "GenerationInput", "GenerationOutput", "GptSession", "SamplingConfig", "WorldConfig",
           "WeightError", "save_gguf_tokenizer", "QuantMode"]
