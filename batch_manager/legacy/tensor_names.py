"""Wire names of request and response tensors (the legacy `tensor_names` module)."""

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
DRAFT_INPUT_IDS = "draft_input_ids"
DRAFT_LOGITS = "draft_logits"
MAX_NEW_TOKENS = "request_output_len"
BEAM_WIDTH = "beam_width"
END_ID = "end_id"
PAD_ID = "pad_id"
BAD_WORDS_LIST = "bad_words_list"
STOP_WORDS_LIST = "stop_words_list"
EMBEDDING_BIAS = "embedding_bias"
TEMPERATURE = "temperature"
RUNTIME_TOP_K = "runtime_top_k"
RUNTIME_TOP_P = "runtime_top_p"
LENGTH_PENALTY = "len_penalty"
EARLY_STOPPING = "early_stopping"
REPETITION_PENALTY = "repetition_penalty"
MIN_LENGTH = "min_length"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"
RANDOM_SEED = "random_seed"
RETURN_LOG_PROBS = "return_log_probs"
RETURN_CONTEXT_LOGITS = "return_context_logits"
RETURN_GENERATION_LOGITS = "return_generation_logits"
PROMPT_EMBEDDING_TABLE = "prompt_embedding_table"
PROMPT_VOCAB_SIZE = "prompt_vocab_size"
LORA_TASK_ID = "lora_task_id"
LORA_WEIGHTS = "lora_weights"
LORA_CONFIG = "lora_config"
NO_REPEAT_NGRAM_SIZE = "noRepeatNgramSize"
INPUT_LENGTHS = "input_lengths"  # obsolete; accepted and ignored
# Extensions (GptSession's SamplingConfig fields, absent from the legacy request):
TOP_P_DECAY = "top_p_decay"
TOP_P_MIN = "top_p_min"
TOP_P_RESET_IDS = "top_p_reset_ids"
BEAM_SEARCH_DIVERSITY_RATE = "beam_search_diversity_rate"
# Beyond the seeds:
MIN_P = "min_p"
NUM_TOP_LOG_PROBS = "num_top_log_probs"
NUM_RETURN_SEQUENCES = "num_return_sequences"

OUTPUT_IDS = "output_ids"
SEQUENCE_LENGTH = "sequence_length"
OUTPUT_LOG_PROBS = "output_log_probs"
CUM_LOG_PROBS = "cum_log_probs"
CONTEXT_LOGITS = "context_logits"
GENERATION_LOGITS = "generation_logits"
TOP_LOG_PROBS = "top_log_probs"          # float32 [1, 1, generated, k], when num_top_log_probs is set
TOP_LOG_PROB_IDS = "top_log_prob_ids"    # int32 [1, 1, generated, k]

# wire name -> InferenceRequest property name (where they differ, the legacy binding's spelling)
INPUT_NAME_TO_PROPERTY = {
    INPUT_IDS: "input_ids", POSITION_IDS: "position_ids", DRAFT_INPUT_IDS: "draft_input_ids",
    DRAFT_LOGITS: "draft_logits", MAX_NEW_TOKENS: "max_new_tokens", BEAM_WIDTH: "beam_width", END_ID: "end_id",
    PAD_ID: "pad_id", BAD_WORDS_LIST: "bad_words_list", STOP_WORDS_LIST: "stop_words_list",
    EMBEDDING_BIAS: "embedding_bias", TEMPERATURE: "temperature", RUNTIME_TOP_K: "runtime_top_k",
    RUNTIME_TOP_P: "runtime_top_p", LENGTH_PENALTY: "length_penalty", EARLY_STOPPING: "early_stopping",
    REPETITION_PENALTY: "repetition_penalty", MIN_LENGTH: "min_length", PRESENCE_PENALTY: "presence_penalty",
    FREQUENCY_PENALTY: "frequency_penalty", RANDOM_SEED: "random_seed", RETURN_LOG_PROBS: "return_log_probs",
    RETURN_CONTEXT_LOGITS: "return_context_logits", RETURN_GENERATION_LOGITS: "return_generation_logits",
    PROMPT_EMBEDDING_TABLE: "prompt_embedding_table", PROMPT_VOCAB_SIZE: "prompt_vocab_size",
    LORA_TASK_ID: "lora_task_id", LORA_WEIGHTS: "lora_weights", LORA_CONFIG: "lora_config",
    NO_REPEAT_NGRAM_SIZE: "no_repeat_ngram_size", INPUT_LENGTHS: "input_lengths",
    TOP_P_DECAY: "top_p_decay", TOP_P_MIN: "top_p_min", TOP_P_RESET_IDS: "top_p_reset_ids",
    BEAM_SEARCH_DIVERSITY_RATE: "beam_search_diversity_rate", MIN_P: "min_p", NUM_TOP_LOG_PROBS: "num_top_log_probs",
    NUM_RETURN_SEQUENCES: "num_return_sequences",
}
INPUT_NAMES = frozenset(INPUT_NAME_TO_PROPERTY)
