//! Learning-rate schedules as the API computes them.

use super::settings::LearningRate;

impl LearningRate {
    /// The rate at `step` (the number of steps already taken), as the API computes it.
    pub fn at(&self, step: u64) -> f64 {
        match *self {
            Self::Constant { learning_rate } => learning_rate,
            Self::ExponentialDecay {
                initial_learning_rate,
                decay_steps,
                decay_factor,
                staircase,
                burnin_learning_rate,
                burnin_steps,
                min_learning_rate,
            } => {
                if step < burnin_steps {
                    return if burnin_learning_rate == 0.0 {
                        initial_learning_rate
                    } else {
                        burnin_learning_rate
                    };
                }
                let p = (step - burnin_steps) as f64 / decay_steps as f64;
                let p = if staircase { p.floor() } else { p };
                (initial_learning_rate * decay_factor.powf(p)).max(min_learning_rate)
            }
            Self::CosineDecay {
                learning_rate_base,
                total_steps,
                warmup_learning_rate,
                warmup_steps,
                hold_base_rate_steps,
            } => {
                if step > total_steps {
                    return 0.0;
                }
                let s = step as f64;
                let denom = (total_steps - warmup_steps - hold_base_rate_steps) as f64;
                let mut lr = 0.5
                    * learning_rate_base
                    * (1.0
                        + (std::f64::consts::PI
                            * (s - warmup_steps as f64 - hold_base_rate_steps as f64)
                            / denom)
                            .cos());
                if hold_base_rate_steps > 0 && step <= warmup_steps + hold_base_rate_steps {
                    lr = learning_rate_base;
                }
                if warmup_steps > 0 && step < warmup_steps {
                    let slope = (learning_rate_base - warmup_learning_rate) / warmup_steps as f64;
                    lr = slope * s + warmup_learning_rate;
                }
                lr
            }
            Self::ManualStep {
                initial_learning_rate,
                ref schedule,
            } => schedule
                .iter()
                .take_while(|(boundary, _)| step >= *boundary)
                .last()
                .map_or(initial_learning_rate, |&(_, lr)| lr),
        }
    }
}
