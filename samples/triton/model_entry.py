"""The Triton Python-backend entry point (copied as `model.py` into each model of the repository):
appends the `python_path` parameter's directories to sys.path and hands over to the class the
`implementation` parameter names (`module:Class`, called with pb_utils, the model config, its name
and version)."""
import importlib
import json
import os
import sys

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        parameters = model_config.get("parameters", {})
        paths = parameters.get("python_path", {}).get("string_value", "")
        # appended: numpy, imported by the stub at its start, stays the stub environment's (1.x)
        sys.path.extend(p for p in paths.split(os.pathsep) if p and p not in sys.path)
        module_name, class_name = parameters["implementation"]["string_value"].split(":")
        implementation = getattr(importlib.import_module(module_name), class_name)
        self.model = implementation(pb_utils, model_config, args["model_name"], args["model_version"])

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
