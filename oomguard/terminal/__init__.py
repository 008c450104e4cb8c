"""Jobs with a terminal: `oomguard exec` (execwrap, with nsinit as the namespace's init), the
pty holder and its client, the terminals outside a dumped tree (external) and at restore,
attach, and the CLI's terminal commands."""
