"""The phases of one RL step (each ``batch -> batch``) and what the loop needs around them."""
