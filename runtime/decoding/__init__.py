"""Decoding: one request's settings and their validation (`params`), the decoder that turns a
step's logits into tokens for any mix of requests (`decoder`, its logits processing in
`processing`), and beam search (`beam_search`)."""
from .decoder import DecodeOutcome, DecodeState, Decoder
from .params import DecodingParams, parse_word_list, to_word_list

__all__ = ["DecodeOutcome", "DecodeState", "Decoder", "DecodingParams", "parse_word_list", "to_word_list"]
