//! The process metrics every Prometheus client library exports, under their usual names
//! (`process_cpu_seconds_total`, `process_resident_memory_bytes`, ...), so that the dashboards
//! and alerts written for them work here: read from /proc at each scrape.

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};

#[derive(Debug, Default)]
pub struct ProcessMetrics;

/// What /proc says of this process.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    cpu_seconds: f64,
    resident_bytes: i64,
    virtual_bytes: i64,
    start_time_seconds: f64,
    open_fds: i64,
    max_fds: i64,
}

impl Sample {
    fn read() -> anyhow::Result<Sample> {
        // SAFETY: sysconf has no preconditions.
        let (ticks, page) = unsafe {
            (
                libc::sysconf(libc::_SC_CLK_TCK) as f64,
                libc::sysconf(libc::_SC_PAGESIZE) as i64,
            )
        };
        let stat = std::fs::read_to_string("/proc/self/stat")?;
        let boot = std::fs::read_to_string("/proc/stat")?;
        let mut sample = Sample::from_stat(&stat, &boot, ticks, page)?;
        sample.open_fds = std::fs::read_dir("/proc/self/fd")?.count() as i64;
        let (soft, _) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)?;
        sample.max_fds = i64::try_from(soft).unwrap_or(i64::MAX);
        Ok(sample)
    }

    /// From /proc/self/stat and /proc/stat (for the boot time), with the clock's ticks per
    /// second and the page size.
    fn from_stat(stat: &str, proc_stat: &str, ticks: f64, page: i64) -> anyhow::Result<Sample> {
        // The command name, in parentheses, may hold spaces: the fields start after its end.
        let (_, rest) = stat
            .rsplit_once(')')
            .ok_or_else(|| anyhow::anyhow!("no command name in /proc/self/stat"))?;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // proc(5) numbers the fields from 1; the state, field 3, comes first here.
        let field = |n: usize| -> anyhow::Result<f64> {
            let text = fields
                .get(n - 3)
                .ok_or_else(|| anyhow::anyhow!("/proc/self/stat has no field {n}"))?;
            Ok(text.parse::<f64>()?)
        };
        let boot: f64 = proc_stat
            .lines()
            .find_map(|l| l.strip_prefix("btime "))
            .ok_or_else(|| anyhow::anyhow!("no btime in /proc/stat"))?
            .trim()
            .parse()?;
        Ok(Sample {
            cpu_seconds: (field(14)? + field(15)?) / ticks,
            start_time_seconds: boot + field(22)? / ticks,
            virtual_bytes: field(23)? as i64,
            resident_bytes: field(24)? as i64 * page,
            open_fds: 0,
            max_fds: 0,
        })
    }
}

impl Collector for ProcessMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sample = match Sample::read() {
            Ok(sample) => sample,
            Err(err) => {
                tracing::warn!("reading the process metrics from /proc: {err:#}");
                return Ok(());
            }
        };
        let cpu = ConstCounter::new(sample.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                sample.resident_bytes as f64,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                sample.virtual_bytes as f64,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                sample.start_time_seconds,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                sample.open_fds as f64,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                sample.max_fds as f64,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_proc_stat_past_a_command_name_with_spaces_and_parentheses() {
        // Fields 3 to 24 of proc(5): utime 250, stime 50, starttime 1000, vsize, rss 300.
        let stat = "4242 (masq (agent) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 \
                    3 0 1000 104857600 300 18446744073709551615";
        let sample = Sample::from_stat(stat, "cpu 1 2 3\nbtime 1700000000\n", 100.0, 4096).unwrap();
        assert_eq!(sample.cpu_seconds, 3.0);
        assert_eq!(sample.start_time_seconds, 1_700_000_010.0);
        assert_eq!(sample.virtual_bytes, 104_857_600);
        assert_eq!(sample.resident_bytes, 300 * 4096);
        assert!(Sample::from_stat("4242 masq", "btime 1\n", 100.0, 4096).is_err());
    }

    #[test]
    fn this_process_reads() {
        let sample = Sample::read().unwrap();
        assert!(sample.open_fds >= 3 && sample.max_fds >= sample.open_fds);
        assert!(sample.resident_bytes > 0 && sample.cpu_seconds >= 0.0);
    }
}
