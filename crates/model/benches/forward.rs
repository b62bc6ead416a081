//! Forward time per image of the default SSD-MobileNet-v1 (37 classes, 300x300) on the CPU
//! (burn-flex, inference mode), for batch 1 and 8: `cargo bench -p model --bench forward`.

use std::time::Instant;

use burn::backend::Flex;
use burn::tensor::Tensor;
use model::SsdConfig;

fn main() {
    let config = SsdConfig::default();
    let device = Default::default();
    let net = config
        .init::<Flex>(0, &device)
        .expect("default config is valid");
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    println!(
        "forward pass, {} classes, {}x{}, burn-flex, {runs} runs after 2 warm-up",
        config.num_classes, config.image_size[0], config.image_size[1]
    );
    for batch in [1usize, 8] {
        let x = Tensor::<Flex, 4>::random(
            [batch, 3, 300, 300],
            burn::tensor::Distribution::Uniform(-1.0, 1.0),
            &device,
        );
        let mut times = Vec::new();
        for i in 0..runs + 2 {
            let start = Instant::now();
            let p = net.forward(x.clone());
            let _ = p.class_logits.into_data();
            if i >= 2 {
                times.push(start.elapsed().as_secs_f64() * 1000.0);
            }
        }
        times.sort_by(f64::total_cmp);
        let per_image = |t: f64| t / batch as f64;
        println!(
            "batch {batch}: per image min {:.1} ms, median {:.1} ms, max {:.1} ms ({:.1} images/s at the median)",
            per_image(times[0]),
            per_image(times[times.len() / 2]),
            per_image(times[times.len() - 1]),
            1000.0 * batch as f64 / times[times.len() / 2]
        );
    }
}
