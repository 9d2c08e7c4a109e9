//! The log lines' timestamp, written as tracing-subscriber's `SystemTime`
//! timer writes it (`2026-12-06T20:23:13.932118Z`, UTC, microseconds) but
//! without the formatting machinery: it runs for every access-log line.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;

/// The wall clock of the log lines (see the module).
#[derive(Debug, Clone, Copy, Default)]
pub struct LogClock;

/// Seconds from 1970 to 10000-01-01: later years are written by
/// tracing-subscriber itself (with a `+`), as are times before 1970.
const YEAR_10000: u64 = 253_402_300_800;

impl FormatTime for LogClock {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(since) if since.as_secs() < YEAR_10000 => {
                w.write_str(Stamp::of(since.as_secs(), since.subsec_micros()).as_str())
            }
            _ => tracing_subscriber::fmt::time::SystemTime.format_time(w),
        }
    }
}

/// `YYYY-MM-DDTHH:MM:SS.uuuuuuZ`.
struct Stamp([u8; 27]);

impl Stamp {
    fn of(secs: u64, micros: u32) -> Stamp {
        let (year, month, day) = civil(secs / 86_400);
        let time = secs % 86_400;
        let mut out = *b"0000-00-00T00:00:00.000000Z";
        digits(&mut out[0..4], year);
        digits(&mut out[5..7], month);
        digits(&mut out[8..10], day);
        digits(&mut out[11..13], time / 3600);
        digits(&mut out[14..16], time / 60 % 60);
        digits(&mut out[17..19], time % 60);
        digits(&mut out[20..26], u64::from(micros));
        Stamp(out)
    }

    fn as_str(&self) -> &str {
        // Only ASCII digits and separators are written.
        std::str::from_utf8(&self.0).unwrap_or("")
    }
}

/// Writes the low decimal digits of `n` into `out`, zero-padded.
fn digits(out: &mut [u8], mut n: u64) {
    for b in out.iter_mut().rev() {
        *b = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

/// Year, month and day of a count of days since 1970-01-01 (proleptic
/// Gregorian; H. Hinnant's `civil_from_days`).
fn civil(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        let cases = [
            (0, 0, "1970-01-01T00:00:00.000000Z"),
            (951_782_400, 7, "2000-02-29T00:00:00.000007Z"),
            (951_868_799, 999_999, "2000-02-29T23:59:59.999999Z"),
            (1_796_587_393, 932_118, "2026-12-06T20:03:13.932118Z"),
            (4_107_542_400, 1, "2100-03-01T00:00:00.000001Z"),
            (YEAR_10000 - 1, 0, "9999-12-31T23:59:59.000000Z"),
        ];
        for (secs, micros, text) in cases {
            assert_eq!(Stamp::of(secs, micros).as_str(), text, "{secs}");
        }
    }

    /// Against tracing-subscriber's own timer, read within the same second.
    #[test]
    fn as_tracing_writes_it() {
        for _ in 0..5 {
            let mut ours = String::new();
            let mut theirs = String::new();
            LogClock.format_time(&mut Writer::new(&mut ours)).unwrap();
            tracing_subscriber::fmt::time::SystemTime
                .format_time(&mut Writer::new(&mut theirs))
                .unwrap();
            assert_eq!(ours.len(), theirs.len());
            if ours[..19] == theirs[..19] {
                assert!(ours.ends_with('Z') && ours.as_bytes()[19] == b'.');
                return;
            }
        }
        panic!("the second changed five times in a row");
    }
}
