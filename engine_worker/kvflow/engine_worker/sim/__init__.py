"""The simulated worker's timing: step shapes, the linear step-time model, profiles
(roofline from a datasheet, or fitted to the real engine) and their files."""
