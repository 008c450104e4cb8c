"""The configuration: its schema and defaults (schema), the values' parsing (values), loading
a TOML file or the command line's flags into it (loading), and which file the CLI reads
(discovery). The checks against the machine are cgroup/configchecks.py."""
