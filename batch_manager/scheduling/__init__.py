"""Who runs when: the scheduler, its capacity and micro-batch stages, the request progress they own, and the step seam."""
