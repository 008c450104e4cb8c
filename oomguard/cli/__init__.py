"""The `oomguard` command line: its arguments (parser), the commands (main), output for people
(rendering, progress), `doctor`, and `install-units`."""
