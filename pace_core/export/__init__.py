"""A configuration's JSON forms and its admission: the complete record (:mod:`pace_core.export.record`, what results
key on), the deployable export (:mod:`pace_core.export.document`, what leaves the project) and the one admission of a
configuration from outside (:mod:`pace_core.export.admission`, :func:`admit`)."""

from pace_core.export.admission import (
    Calibrate,
    ConfigSource,
    ReadyFor,
    admit,
    check_model,
    config_from_dict,
    config_from_json,
    document_from_dict,
    document_from_json,
    read_config,
)
from pace_core.export.document import (
    EXPORT_KIND,
    EXPORT_SCHEMA_VERSION,
    document_from_export,
    export_document,
    export_filename,
    export_json,
    model_block,
    state_layout,
    used_fields,
    used_settings,
)
from pace_core.export.record import (
    PRODUCER_NAME,
    READ_SCHEMA_VERSION,
    SCHEMA_VERSION,
    ConfigDocument,
    config_from_sections,
    config_to_dict,
    config_to_json,
    parse_json,
)

__all__ = [
    "EXPORT_KIND", "EXPORT_SCHEMA_VERSION", "PRODUCER_NAME", "READ_SCHEMA_VERSION", "SCHEMA_VERSION", "Calibrate",
    "ConfigDocument", "ConfigSource", "ReadyFor", "admit", "check_model", "config_from_dict", "config_from_json",
    "config_from_sections", "config_to_dict", "config_to_json", "document_from_dict", "document_from_export",
    "document_from_json", "export_document", "export_filename", "export_json", "model_block", "parse_json",
    "read_config", "state_layout", "used_fields", "used_settings",
]
