"""The `oomguard` command line: its arguments (parser), the commands (main), output for people
(progress; an event's text is observe/rendering.py), `restore --wait` (restorewait),
`doctor`, and `install-units`."""
