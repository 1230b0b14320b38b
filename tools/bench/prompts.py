"""The texts several benchmarks send, kept in one place so that their numbers compare: the same chat
questions for the node, the in-process engine and the servers it is measured against."""

from __future__ import annotations

# Chat questions with long, open answers (the node's throughput benchmark and those that compare with it).
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe a busy market in the morning.",
    "Write a letter to a friend about a trip to the mountains.",
    "Explain why the sky is blue.",
    "Describe your ideal weekend.",
    "Write a poem about autumn leaves.",
    "Explain how plants make food from sunlight.",
]

# A maintenance log with details to copy (speculation's prompt-lookup drafts, n samples of one prompt).
REPORT = (
    "Maintenance log, greenhouse 4, 12 March. At 06:10 the operator Maria Lopez found that irrigation valve "
    "V-3 in row 12 was stuck half open. Soil moisture sensor S-17 read 41 percent, above the 35 percent "
    "target, and the drip line pressure was 1.8 bar. She closed the manual bypass, replaced the valve "
    "solenoid (part number SOL-2240) and tested the valve three times. At 07:05 the moisture reading was "
    "back to 36 percent. Next inspection is due on 19 March. The fan F-2 made a rattling noise and should "
    "be checked by the electrician, Tom Becker, before the end of the week."
)
