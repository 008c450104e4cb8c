"""The response to a crossing, above lifecycle/: the Actor (a victim chosen, its chain run on a
worker) and the action chains (freeze, signal, checkpoint, pageout, kill...: each kind of step
an object, chainsteps.py and pageoutstep.py), with what a chain carries from step to step
(chainstate.py). The actuators they drive are in act/."""
