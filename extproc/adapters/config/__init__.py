"""The YAML configuration: typed, checked once at start-up, resolved into what the program reads.

Every setting is read here and nowhere else, so mistakes are refused before
the server binds a port, each with its line and key path
(``config.yaml:12: models[1].target_waiting: must be an integer >= 1, got 'three'``),
all of them at once. One module per step, each importing only the ones above it:

* ``values.py``    what a leaf must be: the constrained types (``Address``, ``Count``...), and a section's base;
* ``advanced.py``  the ``advanced:`` section, what only a developer tunes;
* ``instances.py`` the sections of several instances: ``shards`` and ``cluster``;
* ``schema.py``    the file's shape: one msgspec struct per section (:class:`ConfigFile`);
* ``validate.py``  a document converted into those structs, every mistake with its key path;
* ``resolve.py``   :class:`Config`, what the program reads: bands and tenants in the core's types;
* ``rules.py``     the rules between fields (and the TLS files loaded), run by validate.py;
* ``load.py``      a file (or document) checked and resolved, each mistake with its line;
* ``keys.py``      every key the file may hold, walked from the schema (the reference's rows);
* ``explain.py``   the effective configuration, each key with its source (``check-config --explain``).

The names below are the package's surface; callers import them from here.
"""

from extproc.adapters.config.advanced import AdvancedSettings, GrpcLimits
from extproc.adapters.config.instances import ClusterInstance, ClusterSettings, Shard
from extproc.adapters.config.load import load_config, parse_config, parse_config_text
from extproc.adapters.config.resolve import Config, ConfigError
from extproc.adapters.config.schema import (
    ENGINES,
    BandSettings,
    CostSettings,
    EndpointPickerSettings,
    EnvoySettings,
    Identity,
    JwtSettings,
    Listen,
    ModelConfig,
    PrefixSettings,
    TenantSettings,
    TlsSettings,
)
from extproc.adapters.config.values import is_ip_address, split_address

__all__ = [
    "ENGINES",
    "AdvancedSettings",
    "BandSettings",
    "ClusterInstance",
    "ClusterSettings",
    "Config",
    "ConfigError",
    "CostSettings",
    "EndpointPickerSettings",
    "EnvoySettings",
    "GrpcLimits",
    "Identity",
    "JwtSettings",
    "Listen",
    "ModelConfig",
    "PrefixSettings",
    "Shard",
    "TenantSettings",
    "TlsSettings",
    "is_ip_address",
    "load_config",
    "parse_config",
    "parse_config_text",
    "split_address",
]
