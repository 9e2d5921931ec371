//! A headless Chromium (Debian's `chromium`) driven over the DevTools protocol with
//! chromiumoxide, for the console's tests: navigation, clicks and typing, screenshots at a
//! chosen width, and every console error and uncaught exception a page produced.
//!
//! A test that needs the browser fails, naming the package, when it cannot be found or
//! started: it never skips. `deploy/local/tools.sh` installs it.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chromiumoxide::cdp::browser_protocol::emulation::SetDeviceMetricsOverrideParams;
use chromiumoxide::cdp::browser_protocol::log::{EventEntryAdded, LogEntryLevel};
use chromiumoxide::cdp::js_protocol::runtime::{
    ConsoleApiCalledType, EventConsoleApiCalled, EventExceptionThrown,
};
use chromiumoxide::page::ScreenshotParams;
use chromiumoxide::{Browser, BrowserConfig, Page};
use futures_util::StreamExt;

/// Where Debian's package puts the browser; `SENDQUOTA_TEST_CHROMIUM` names another.
const DEFAULT_CHROMIUM: &str = "/usr/bin/chromium";

/// Longest wait for a page to show what a test waits for.
const PAGE_TIMEOUT: Duration = Duration::from_secs(15);

/// A running headless browser with one page, and what its pages reported as errors.
pub struct Chromium {
    browser: Browser,
    pub page: Page,
    errors: Arc<Mutex<Vec<String>>>,
    /// Its profile directory, removed on drop.
    profile: PathBuf,
}

impl Chromium {
    /// Starts the browser, failing the test with how to install it when it cannot.
    pub async fn start() -> Chromium {
        let executable = std::env::var("SENDQUOTA_TEST_CHROMIUM")
            .unwrap_or_else(|_| DEFAULT_CHROMIUM.to_owned());
        assert!(
            std::path::Path::new(&executable).exists(),
            "chromium not found at {executable}: install Debian's `chromium` package \
             (deploy/local/tools.sh does, and deploy/local/test.sh runs it) or set \
             SENDQUOTA_TEST_CHROMIUM"
        );
        let profile = std::env::temp_dir().join(super::unique("sqchromium"));
        let config = BrowserConfig::builder()
            .chrome_executable(&executable)
            .new_headless_mode()
            // As root (CI, containers) Chromium refuses to start with its sandbox.
            .no_sandbox()
            .user_data_dir(&profile)
            .window_size(1280, 900)
            .viewport(None)
            .arg("--disable-gpu")
            .arg("--no-first-run")
            .build()
            .unwrap_or_else(|e| panic!("chromium configuration: {e}"));
        let (browser, mut handler) = Browser::launch(config).await.unwrap_or_else(|e| {
            panic!("chromium at {executable} did not start: {e}; is Debian's `chromium` installed?")
        });
        tokio::spawn(async move { while handler.next().await.is_some() {} });
        let page = browser
            .new_page("about:blank")
            .await
            .expect("chromium opens a page");
        page.enable_log().await.expect("enable the Log domain");
        page.enable_runtime()
            .await
            .expect("enable the Runtime domain");
        let errors = Arc::new(Mutex::new(Vec::new()));
        collect_errors(&page, &errors).await;
        Chromium {
            browser,
            page,
            errors,
            profile,
        }
    }

    /// Makes the page `width` CSS pixels wide (and 900 high).
    pub async fn set_width(&self, width: i64) {
        self.page
            .execute(SetDeviceMetricsOverrideParams::new(
                width,
                900,
                1.0,
                width < 600,
            ))
            .await
            .expect("set the page's width");
    }

    /// Opens `url` and waits until it has loaded (see [`Chromium::left_and_loaded`]).
    pub async fn open(&self, url: &str) {
        self.mark_leaving().await;
        self.page
            .goto(url)
            .await
            .unwrap_or_else(|e| panic!("open {url}: {e}"));
        self.left_and_loaded().await;
    }

    /// Marks the document shown now, so [`Chromium::left_and_loaded`] can tell it is gone.
    async fn mark_leaving(&self) {
        self.eval::<bool>("(window.sendquotaLeaving = true)").await;
    }

    /// Waits until the document marked by [`Chromium::mark_leaving`] is gone and the next one
    /// has loaded: the protocol's navigation events can come before the new document does.
    async fn left_and_loaded(&self) {
        self.wait_for(
            "window.sendquotaLeaving === undefined && document.readyState === 'complete'",
        )
        .await;
    }

    /// The element `selector` names; the test fails when there is none.
    async fn element(&self, selector: &str) -> chromiumoxide::Element {
        self.page
            .find_element(selector)
            .await
            .unwrap_or_else(|e| panic!("find {selector}: {e}"))
    }

    /// Clicks the element `selector` names and waits for the page it leads to: until the
    /// document the click left (marked before it) is gone and the new one has loaded.
    pub async fn click_through(&self, selector: &str) {
        self.mark_leaving().await;
        self.element(selector)
            .await
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {selector}: {e}"));
        self.left_and_loaded().await;
    }

    /// Types `text` into the field `selector` names (after what it holds).
    pub async fn type_into(&self, selector: &str, text: &str) {
        self.element(selector)
            .await
            .click()
            .await
            .unwrap_or_else(|e| panic!("focus {selector}: {e}"))
            .type_str(text)
            .await
            .unwrap_or_else(|e| panic!("type into {selector}: {e}"));
    }

    /// The value of the JavaScript expression `js` on the page. Evaluated again while the
    /// page that was just loaded has no script context yet.
    pub async fn eval<T: serde::de::DeserializeOwned>(&self, js: &str) -> T {
        let deadline = Instant::now() + PAGE_TIMEOUT;
        loop {
            match self.page.evaluate(js).await {
                Ok(value) => {
                    return value
                        .into_value()
                        .unwrap_or_else(|e| panic!("the value of {js}: {e}"))
                }
                Err(e) if e.to_string().contains("context") && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("evaluate {js}: {e}"),
            }
        }
    }

    /// The page's visible text.
    pub async fn text(&self) -> String {
        self.eval("document.body.innerText").await
    }

    /// The page's URL path and query.
    pub async fn path(&self) -> String {
        self.eval("location.pathname + location.search").await
    }

    /// Waits until the JavaScript expression `js` is true on the page.
    pub async fn wait_for(&self, js: &str) {
        let deadline = Instant::now() + PAGE_TIMEOUT;
        while !self.eval::<bool>(js).await {
            assert!(Instant::now() < deadline, "the page never showed {js}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Saves a screenshot of the whole page to `docs/screenshots/<name>.png`.
    pub async fn screenshot(&self, name: &str) {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/screenshots");
        std::fs::create_dir_all(&dir).expect("create docs/screenshots");
        let params = ScreenshotParams::builder().full_page(true).build();
        self.page
            .save_screenshot(params, dir.join(format!("{name}.png")))
            .await
            .unwrap_or_else(|e| panic!("screenshot {name}: {e}"));
    }

    /// Every console error, failed load and uncaught exception the pages reported so far.
    pub fn errors(&self) -> Vec<String> {
        self.errors.lock().expect("errors lock").clone()
    }

    /// Closes the browser.
    pub async fn close(mut self) {
        let _ = self.browser.close().await;
        let _ = self.browser.wait().await;
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// Records into `errors` every `console.error` (and failed `console.assert`), every entry the
/// browser logs at error level (a failed load, a refused script) and every uncaught exception.
async fn collect_errors(page: &Page, errors: &Arc<Mutex<Vec<String>>>) {
    collect::<EventConsoleApiCalled>(page, errors, |event| {
        let error = matches!(
            event.r#type,
            ConsoleApiCalledType::Error | ConsoleApiCalledType::Assert
        );
        error.then(|| {
            let args: Vec<String> = event
                .args
                .iter()
                .map(|a| {
                    a.value
                        .as_ref()
                        .map(|v| v.to_string())
                        .or_else(|| a.description.clone())
                        .unwrap_or_default()
                })
                .collect();
            format!("console.{:?}: {}", event.r#type, args.join(" "))
        })
    })
    .await;
    collect::<EventEntryAdded>(page, errors, |event| {
        let e = &event.entry;
        (e.level == LogEntryLevel::Error)
            .then(|| format!("log: {} ({})", e.text, e.url.clone().unwrap_or_default()))
    })
    .await;
    collect::<EventExceptionThrown>(page, errors, |event| {
        let d = &event.exception_details;
        let what = d
            .exception
            .as_ref()
            .and_then(|e| e.description.clone())
            .unwrap_or_else(|| d.text.clone());
        Some(format!(
            "exception: {what} at {}:{}",
            d.url.clone().unwrap_or_default(),
            d.line_number
        ))
    })
    .await;
}

/// Records into `errors` what `report` makes of each event `T` of the page (`None`: not an
/// error).
async fn collect<T>(
    page: &Page,
    errors: &Arc<Mutex<Vec<String>>>,
    report: impl Fn(&T) -> Option<String> + Send + 'static,
) where
    T: chromiumoxide::cdp::IntoEventKind + Unpin + Send + 'static,
{
    let mut events = page
        .event_listener::<T>()
        .await
        .unwrap_or_else(|e| panic!("listen to {}: {e}", std::any::type_name::<T>()));
    let sink = errors.clone();
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            if let Some(error) = report(&event) {
                sink.lock().expect("errors lock").push(error);
            }
        }
    });
}
