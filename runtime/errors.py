"""The runtime's error for bad configuration: `ConfigError`. A leaf (imports nothing of the project), so
the config module and the weight-format entries that both raise it need not import each other."""


class ConfigError(ValueError):
    """A config file or value that the runtime cannot use; the message names the field."""
