"""The request core, shared by every door (GptManager's tensors, the Executor's `Request`,
GptSession's inputs, the serving sample's JSON): what was asked (`RequestSpec`, frozen), the one
record of what it produced (`RequestOutput`), the door-independent checks (`make_spec`), and
`render`. A torch-free leaf: doors make the tensors."""
from .checks import (AdmissionLimits, RequestError, check_decoding, check_drafts, check_prompt, check_range,
                     clamped_new_tokens, make_spec)
from .output import BeamOutputs, RequestOutput, SequenceOutput
from .render import Rendered, render
from .spec import FinishReason, RequestSpec, ResumedContext

__all__ = ["AdmissionLimits", "BeamOutputs", "FinishReason", "Rendered", "RequestError", "RequestOutput",
           "RequestSpec", "ResumedContext", "SequenceOutput", "check_decoding", "check_drafts", "check_prompt",
           "check_range", "clamped_new_tokens", "make_spec", "render"]
