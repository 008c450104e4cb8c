"""The configuration: its schema and defaults (schema), the values' parsing (values), loading
a TOML file or the command line's flags into it (loading), the checks beyond the schema
(checks), and which file the CLI reads (discovery)."""
