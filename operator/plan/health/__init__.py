"""The job-health rules: pure verdicts on how a running job is doing, from its pods, nodes
and the members' reports and stats.

Members lost (node NotReady, Unready too long, containers restarting or crash-looping),
members slow for good (stragglers, and the nodes kept out of the plan for them), how long
the last recovery took, goodput and the checkpoint interval, whether checkpoints are
failing, and whether the work is done. The round's steps
(:mod:`ringwright.operator.plan.round`) turn these verdicts into status, conditions,
events and pods to replace.
"""
